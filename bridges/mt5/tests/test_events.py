"""The event stream, made by polling: changes made outside the bridge (a person trading in
the terminal, the server's own stops) reach every connection that logged the account in."""

import MetaTrader5 as mt5
from MetaTrader5 import _terminal as t



def test_a_manual_trade_is_streamed_from_open_to_close(acct):
    node, fake, login = acct.client, acct.fake, acct.login
    ticket = fake.manual_open(login, "GBPUSD", "sell", 0.5, comment="by hand")
    opened = node.change("opened", ticket)["position"]
    assert (opened["side"], opened["volume"], opened["magic"], opened["comment"]) == (
        "sell", 0.5, 0, "by hand")
    fake.manual_modify(login, ticket, sl=1.3, tp=1.2)
    modified = node.change("modified", ticket)["position"]
    assert (modified["sl"], modified["tp"]) == (1.3, 1.2)
    fake.manual_close(login, ticket, 0.2)
    partial = node.change("partially_closed", ticket)
    assert partial["position"]["volume"] == 0.3
    assert partial["closed"]["volume"] == 0.2 and partial["closed"]["closed_by"] == "manual"
    fake.manual_close(login, ticket)
    closed = node.change("closed", ticket)["closed"]
    assert (closed["volume"], closed["remaining_volume"], closed["closed_by"]) == (0.3, 0.0,
                                                                                  "manual")
    kinds = [e["change"] for e in node.events if e.get("position", e.get("closed", {}))
             .get("ticket") == ticket]
    assert kinds == ["opened", "modified", "partially_closed", "closed"]


def test_manual_pending_orders_are_streamed(acct):
    node, fake, login = acct.client, acct.fake, acct.login
    ticket = fake.manual_place(login, "EURUSD", mt5.ORDER_TYPE_SELL_LIMIT, 1.12, 0.3)
    placed = node.change("order_placed", ticket)["order"]
    assert (placed["side"], placed["kind"], placed["price"], placed["volume"]) == (
        "sell", "limit", 1.12, 0.3)
    fake.manual_amend(login, ticket, 1.125)
    assert node.change("order_changed", ticket)["order"]["price"] == 1.125
    fake.manual_cancel(login, ticket)
    assert node.change("order_gone", ticket)["end"] == "cancelled"


def test_several_changes_between_two_polls_are_each_streamed(acct):
    node, fake, login = acct.client, acct.fake, acct.login
    ticket = fake.manual_open(login, "EURUSD", "buy", 1.0)
    node.change("opened", ticket)
    # Two partial closes and the rest in one hold of the terminal: the worker cannot look in
    # between.
    with fake._edit() as state:
        book = state["accounts"][login]
        position = book["positions"][0]
        sym = state["symbols"]["EURUSD"]
        for volume in (0.2, 0.3, 0.5):
            t.close_part(state, book, position, volume, sym["bid"], reason=0, magic=0,
                         comment="")
    closed = node.change("closed", ticket)
    partials = [e for e in node.events if e["change"] == "partially_closed"]
    assert [(e["closed"]["volume"], e["position"]["volume"]) for e in partials] == [
        (0.2, 0.8), (0.3, 0.5)]
    assert closed["closed"]["volume"] == 0.5


def test_take_profit_closes_are_streamed_as_the_servers(acct):
    node, login = acct.client, acct.login
    fill = node.result("open", login=login, fence=1, symbol="EURUSD", side="sell", volume=0.1,
                       sl=None, tp=1.09, magic=3, comment="mc5", client_order_id="o")
    acct.fake.set_price("EURUSD", 1.0899)
    closed = node.change("closed", fill["ticket"])["closed"]
    assert (closed["closed_by"], closed["comment"], closed["magic"]) == ("tp", "mc5", 3)


def test_every_connection_of_the_account_hears_it(acct):
    first, second = acct.client, acct.bridge.session(acct.login)
    other = acct.bridge.client()  # said hello, logged nothing in
    ticket = acct.fake.manual_open(acct.login, "EURUSD", "buy", 0.1)
    assert first.change("opened", ticket) and second.change("opened", ticket)
    assert other.events == []


def test_an_orders_events_go_before_its_reply(acct):
    node, login = acct.client, acct.login
    request_id = node.send("open", login=login, fence=1, symbol="EURUSD", side="buy",
                           volume=0.1, sl=None, tp=None, magic=3, comment="mc5",
                           client_order_id="o")
    reply = node.reply(request_id)
    opened = node.change("opened", reply["result"]["ticket"])
    assert node.frames.index(opened) < node.frames.index(reply)
