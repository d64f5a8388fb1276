"""Orders through the bridge: markers kept on positions and history, partial closes under the
same ticket, stop changes, pending orders, and refusals with the protocol's codes."""

import MetaTrader5 as mt5
import pytest


MAGIC = 100001
MARKER = "mc1000042"


def open_copy(acct, volume=0.5, side="sell", comment=MARKER, **extra):
    fields = dict(login=acct.login, fence=7, symbol="EURUSD", side=side, volume=volume, sl=None,
                  tp=None, magic=MAGIC, comment=comment, client_order_id="l7-m1000042-open")
    fields.update(extra)
    return acct.client.result("open", **fields)


def positions(acct):
    held = acct.client.result("positions", login=acct.login)["positions"]
    return {p["ticket"]: p for p in held}


def test_an_open_keeps_its_magic_and_comment(acct):
    fill = open_copy(acct)
    assert fill["duplicate"] is False
    assert fill["price"] == 1.1  # a sell fills at the bid
    held = positions(acct)[fill["ticket"]]
    assert held["magic"] == MAGIC and held["comment"] == MARKER
    assert held["side"] == "sell" and held["volume"] == 0.5 and held["open_price"] == 1.1
    assert held["sl"] is None and held["tp"] is None and held["open_time_ms"] > 0
    # The order went to the terminal as asked: the opening deal carries the marker too.
    deal = acct.fake.deals(acct.login)[0]
    assert (deal["magic"], deal["comment"], deal["entry"]) == (MAGIC, MARKER, mt5.DEAL_ENTRY_IN)


def test_an_open_is_streamed_with_its_marker(acct):
    node = acct.client
    fill = open_copy(acct)
    event = node.change("opened", fill["ticket"])
    assert event["login"] == acct.login
    assert event["position"]["comment"] == MARKER and event["position"]["magic"] == MAGIC


def test_stops_given_at_open_are_set(acct):
    fill = open_copy(acct, side="buy", sl=1.09, tp=1.12)
    held = positions(acct)[fill["ticket"]]
    assert (held["sl"], held["tp"]) == (1.09, 1.12)


def test_a_partial_close_leaves_the_remainder_under_its_ticket_and_marker(acct):
    node, login = acct.client, acct.login
    ticket = open_copy(acct)["ticket"]
    fill = node.result("close", login=login, fence=7, ticket=ticket, volume=0.2,
                       client_order_id="l7-m1000042-c1-trim0.3")
    assert fill == {"ticket": ticket, "closed_volume": 0.2, "remaining_volume": 0.3,
                    "price": 1.10002, "duplicate": False}
    remainder = positions(acct)[ticket]
    assert remainder["volume"] == 0.3
    assert (remainder["magic"], remainder["comment"]) == (MAGIC, MARKER)
    event = node.change("partially_closed", ticket)
    assert event["position"]["volume"] == 0.3 and event["position"]["comment"] == MARKER
    assert event["closed"]["volume"] == 0.2 and event["closed"]["remaining_volume"] == 0.3
    assert event["closed"]["comment"] == MARKER


def test_a_close_shows_in_the_history_with_its_marker(acct):
    node, login = acct.client, acct.login
    ticket = open_copy(acct)["ticket"]
    node.result("close", login=login, fence=7, ticket=ticket, volume=0.2, client_order_id="a")
    fill = node.result("close", login=login, fence=7, ticket=ticket, volume=None,
                       client_order_id="b")
    assert (fill["closed_volume"], fill["remaining_volume"]) == (0.3, 0.0)
    assert ticket not in positions(acct)
    history = node.result("history", login=login)["history"]
    assert [(h["ticket"], h["volume"], h["remaining_volume"]) for h in history] == [
        (ticket, 0.2, 0.3), (ticket, 0.3, 0.0)]
    for entry in history:
        assert (entry["magic"], entry["comment"], entry["side"]) == (MAGIC, MARKER, "sell")
        assert entry["closed_by"] == "client"
        assert entry["open_price"] == 1.1 and entry["close_price"] == 1.10002
        assert entry["profit"] < 0
    closed = node.change("closed", ticket)
    assert closed["closed"]["comment"] == MARKER and closed["closed"]["volume"] == 0.3


def test_a_stop_loss_close_keeps_the_marker_the_broker_overwrote_on_its_deal(acct):
    node, login = acct.client, acct.login
    ticket = open_copy(acct, side="buy", sl=1.095)["ticket"]
    acct.fake.set_price("EURUSD", 1.0949)
    closed = node.change("closed", ticket)["closed"]
    assert closed["closed_by"] == "sl" and closed["comment"] == MARKER
    closing_deal = acct.fake.deals(acct.login)[-1]
    assert closing_deal["comment"].startswith("[sl ")
    (entry,) = node.result("history", login=login)["history"]
    assert (entry["comment"], entry["magic"], entry["closed_by"]) == (MARKER, MAGIC, "sl")


def test_stops_are_changed_and_removed(acct):
    node, login = acct.client, acct.login
    ticket = open_copy(acct, side="buy")["ticket"]
    assert node.result("modify", login=login, fence=7, ticket=ticket, sl=1.09, tp=1.2,
                       client_order_id="s1") == ticket
    assert (positions(acct)[ticket]["sl"], positions(acct)[ticket]["tp"]) == (1.09, 1.2)
    event = node.change("modified", ticket)
    assert (event["position"]["sl"], event["position"]["tp"]) == (1.09, 1.2)
    node.result("modify", login=login, fence=7, ticket=ticket, sl=None, tp=1.2,
                client_order_id="s2")
    assert positions(acct)[ticket]["sl"] is None
    sends = acct.fake.order_send_count()
    # Stops already as asked: nothing to send, and not a refusal.
    assert node.result("modify", login=login, fence=7, ticket=ticket, sl=None, tp=1.2,
                       client_order_id="s3") == ticket
    assert acct.fake.order_send_count() == sends


def test_invalid_stops_are_refused_with_their_code(acct):
    node, login = acct.client, acct.login
    ticket = open_copy(acct, side="buy")["ticket"]
    error = node.error("modify", login=login, fence=7, ticket=ticket, sl=1.2, tp=None,
                       client_order_id="s")
    assert error["code"] == "invalid_stops" and "10016" in error["reason"]


def test_closing_or_modifying_an_unknown_ticket_is_unknown_ticket(acct):
    node, login = acct.client, acct.login
    assert node.error("close", login=login, fence=7, ticket=424242, volume=None,
                      client_order_id="c")["code"] == "unknown_ticket"
    assert node.error("modify", login=login, fence=7, ticket=424242, sl=None, tp=None,
                      client_order_id="m")["code"] == "unknown_ticket"


def test_closing_more_than_the_position_holds_is_invalid_volume(acct):
    node, login = acct.client, acct.login
    ticket = open_copy(acct, volume=0.1)["ticket"]
    sends = acct.fake.order_send_count()
    error = node.error("close", login=login, fence=7, ticket=ticket, volume=0.2,
                       client_order_id="c")
    assert error["code"] == "invalid_volume"
    assert acct.fake.order_send_count() == sends


def test_volumes_off_the_step_and_unknown_symbols_are_refused(acct):
    node, login = acct.client, acct.login
    assert node.error("open", login=login, fence=7, symbol="EURUSD", side="buy", volume=0.015,
                      sl=None, tp=None, magic=1, comment="", client_order_id="v")["code"] \
        == "invalid_volume"
    assert node.error("open", login=login, fence=7, symbol="BTCUSD", side="buy", volume=0.1,
                      sl=None, tp=None, magic=1, comment="", client_order_id="u")["code"] \
        == "unknown_symbol"


def test_a_comment_over_31_characters_is_refused_not_cut(acct):
    node, login = acct.client, acct.login
    long_marker = "mc" + "9" * 30  # 32 characters
    error = node.error("open", login=login, fence=7, symbol="EURUSD", side="buy", volume=0.1,
                       sl=None, tp=None, magic=1, comment=long_marker, client_order_id="x")
    assert error["kind"] == "invalid" and error["code"] == "invalid_request"
    assert "31" in error["reason"]
    assert acct.sends() == 0
    assert positions(acct) == {}
    # Characters as MT5 counts them (UTF-16): 16 characters outside the BMP are 32 units.
    assert node.error("place", login=login, fence=7, symbol="EURUSD", side="buy", kind="limit",
                      price=1.09, volume=0.1, sl=None, tp=None, magic=1, comment="😀" * 16,
                      client_order_id="p")["kind"] == "invalid"


def test_a_31_character_comment_is_kept_whole(acct):
    marker = "mc" + "1" * 29
    ticket = open_copy(acct, comment=marker)["ticket"]
    assert positions(acct)[ticket]["comment"] == marker


def test_a_price_limit_already_passed_is_refused_as_slippage(acct):
    node, login = acct.client, acct.login
    # A buy fills at the ask, 1.10002: a limit below it cannot be met.
    error = node.error("open", login=login, fence=7, symbol="EURUSD", side="buy", volume=0.1,
                       sl=None, tp=None, magic=1, comment="mc1", client_order_id="x",
                       price_limit=1.1)
    assert error["code"] == "slippage"
    assert acct.sends() == 0


def test_a_price_limit_becomes_the_orders_deviation(acct):
    node, login = acct.client, acct.login
    fill = node.result("open", login=login, fence=7, symbol="EURUSD", side="buy", volume=0.1,
                       sl=None, tp=None, magic=1, comment="mc1", client_order_id="x",
                       price_limit=1.10005)
    assert fill["price"] == 1.10002
    sent = acct.fake.last_request()
    # 1.10005 - 1.10002 = 3 points of 0.00001: the most the terminal may let the price slip.
    assert (sent["price"], sent["deviation"]) == (1.10002, 3)
    assert sent["type_filling"] == mt5.ORDER_FILLING_FOK
    open_copy(acct)
    assert acct.fake.last_request()["deviation"] == 20  # the configured default


def test_no_money_is_refused_with_its_code(acct):
    node, login = acct.client, acct.login
    error = node.error("open", login=login, fence=7, symbol="EURUSD", side="buy", volume=100.0,
                       sl=None, tp=None, magic=1, comment="mc1", client_order_id="x")
    assert error["code"] == "no_money" and "10019" in error["reason"]


def test_a_closed_market_is_market_closed(acct):
    node, login = acct.client, acct.login
    acct.fake.set_market_open("EURUSD", False)
    error = node.error("open", login=login, fence=7, symbol="EURUSD", side="buy", volume=0.1,
                       sl=None, tp=None, magic=1, comment="mc1", client_order_id="x")
    assert error["code"] == "market_closed"


def test_autotrading_switched_off_in_the_terminal_is_refused(acct):
    node, login = acct.client, acct.login
    acct.fake.set_autotrading(False)
    error = node.error("open", login=login, fence=7, symbol="EURUSD", side="buy", volume=0.1,
                       sl=None, tp=None, magic=1, comment="mc1", client_order_id="x")
    assert error["code"] == "rejected" and "10027" in error["reason"]


def test_a_partial_fill_reports_the_filled_volume(acct):
    node, login = acct.client, acct.login
    acct.fake.inject_retcode(mt5.TRADE_RETCODE_DONE_PARTIAL, action=mt5.TRADE_ACTION_DEAL)
    fill = open_copy(acct, volume=0.5)
    assert fill["volume"] == 0.25
    assert positions(acct)[fill["ticket"]]["volume"] == 0.25
    acct.fake.inject_retcode(mt5.TRADE_RETCODE_DONE_PARTIAL, action=mt5.TRADE_ACTION_DEAL)
    close = node.result("close", login=login, fence=7, ticket=fill["ticket"], volume=0.2,
                        client_order_id="c")
    assert (close["closed_volume"], close["remaining_volume"]) == (0.1, 0.15)


# --- pending orders ------------------------------------------------------------------------


def place(acct, price=1.09, kind="limit", side="buy", **extra):
    fields = dict(login=acct.login, fence=7, symbol="EURUSD", side=side, kind=kind, price=price,
                  volume=0.4, sl=None, tp=None, magic=MAGIC, comment="mc77",
                  client_order_id="p")
    fields.update(extra)
    return acct.client.result("place", **fields)


def orders(acct):
    return {o["ticket"]: o for o in acct.client.result("orders", login=acct.login)["orders"]}


def test_a_pending_order_is_placed_amended_and_cancelled(acct):
    node, login = acct.client, acct.login
    placed = place(acct, tp=1.12)
    assert placed["duplicate"] is False
    ticket = placed["ticket"]
    order = orders(acct)[ticket]
    assert {k: order[k] for k in ("side", "kind", "price", "volume", "sl", "tp", "magic",
                                  "comment")} == {
        "side": "buy", "kind": "limit", "price": 1.09, "volume": 0.4, "sl": None, "tp": 1.12,
        "magic": MAGIC, "comment": "mc77"}
    assert "expiry_ms" not in order and order["placed_ms"] > 0
    assert node.change("order_placed", ticket)["order"]["comment"] == "mc77"

    amended = node.result("amend", login=login, fence=7, ticket=ticket, price=1.085, sl=1.08,
                          tp=None, client_order_id="a")
    assert amended == {"ticket": ticket, "duplicate": False}
    order = orders(acct)[ticket]
    assert (order["price"], order["sl"], order["tp"]) == (1.085, 1.08, None)
    assert node.change("order_changed", ticket)["order"]["price"] == 1.085

    assert node.result("cancel", login=login, fence=7, ticket=ticket,
                       client_order_id="x") == {"ticket": ticket, "duplicate": False}
    assert orders(acct) == {}
    gone = node.change("order_gone", ticket)
    assert gone["end"] == "cancelled"


def test_a_pending_order_with_an_expiry(acct):
    node, login = acct.client, acct.login
    import time
    expiry_ms = int(time.time() * 1000) + 3_600_000
    ticket = place(acct, expiry_ms=expiry_ms)["ticket"]
    assert orders(acct)[ticket]["expiry_ms"] == expiry_ms // 1000 * 1000
    with acct.fake._edit() as state:
        state["accounts"][acct.login]["orders"][0]["time_expiration"] = int(time.time()) - 1
    assert node.change("order_gone", ticket)["end"] == "expired"
    error = node.error("place", login=login, fence=7, symbol="EURUSD", side="buy",
                       kind="limit", price=1.09, volume=0.4, sl=None, tp=None, magic=1,
                       comment="", client_order_id="p", expiry_ms=1000)
    assert error["code"] == "rejected" and "10022" in error["reason"]


def test_a_filled_pending_order_becomes_a_position_under_its_ticket(acct):
    node = acct.client
    ticket = place(acct, price=1.105, kind="stop")["ticket"]
    acct.fake.set_price("EURUSD", 1.1051)
    gone = node.change("order_gone", ticket)
    assert (gone["end"], gone["position"]) == ("filled", ticket)
    opened = node.change("opened", ticket)
    assert node.events.index(gone) < node.events.index(opened)
    held = positions(acct)[ticket]
    assert (held["magic"], held["comment"], held["side"]) == (MAGIC, "mc77", "buy")


def test_a_pending_price_on_the_wrong_side_is_refused(acct):
    node, login = acct.client, acct.login
    error = node.error("place", login=login, fence=7, symbol="EURUSD", side="buy",
                       kind="limit", price=1.2, volume=0.4, sl=None, tp=None, magic=1,
                       comment="", client_order_id="p")
    assert error["code"] == "rejected" and "10015" in error["reason"]


def test_amending_or_cancelling_an_unknown_order_is_unknown_ticket(acct):
    node, login = acct.client, acct.login
    assert node.error("amend", login=login, fence=7, ticket=31337, price=1.0, sl=None, tp=None,
                      client_order_id="a")["code"] == "unknown_ticket"
    assert node.error("cancel", login=login, fence=7, ticket=31337,
                      client_order_id="c")["code"] == "unknown_ticket"


@pytest.mark.parametrize("side,kind,price", [("sell", "limit", 1.11), ("sell", "stop", 1.09),
                                             ("buy", "stop", 1.11)])
def test_every_pending_kind_maps_to_its_mt5_order_type(acct, side, kind, price):
    ticket = place(acct, side=side, kind=kind, price=price)["ticket"]
    order = orders(acct)[ticket]
    assert (order["side"], order["kind"]) == (side, kind)
    expected = {("sell", "limit"): mt5.ORDER_TYPE_SELL_LIMIT,
                ("sell", "stop"): mt5.ORDER_TYPE_SELL_STOP,
                ("buy", "stop"): mt5.ORDER_TYPE_BUY_STOP}[(side, kind)]
    assert acct.fake.orders(acct.login)[0]["type"] == expected
