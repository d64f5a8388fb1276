"""Requests for different terminals run at once in their own workers; requests on one
connection are pipelined and each reply goes to its own request."""

import time

TWO = {"t1": {"50112": {}}, "t2": {"60223": {}}}


def open_fields(login, comment):
    return dict(login=login, fence=1, symbol="EURUSD", side="buy", volume=0.1, sl=None,
                tp=None, magic=11, comment=comment, client_order_id=comment)


def test_two_logins_on_two_terminals_trade_at_the_same_time(make_bridge):
    bridge = make_bridge(TWO)
    bridge.fake("t1").slow_order_send(1.0)
    client = bridge.client()
    client.login("50112", "secret")
    client.login("60223", "secret")
    started = time.monotonic()
    slow = client.send("open", **open_fields("50112", "mc1"))
    fast = client.send("open", **open_fields("60223", "mc2"))
    fast_reply = client.reply(fast)
    fast_after = time.monotonic() - started
    slow_reply = client.reply(slow)
    assert fast_reply["ok"] and slow_reply["ok"]
    # The second terminal did not wait for the first: its reply came first, out of order.
    assert fast_after < 0.8
    assert client.frames.index(fast_reply) < client.frames.index(slow_reply)
    assert bridge.fake("t1").positions("50112")[0]["comment"] == "mc1"
    assert bridge.fake("t2").positions("60223")[0]["comment"] == "mc2"


def test_two_nodes_on_two_terminals_each_hear_only_their_account(make_bridge):
    bridge = make_bridge(TWO)
    first, second = bridge.session("50112"), bridge.session("60223")
    a = first.send("open", **open_fields("50112", "mc1"))
    b = second.send("open", **open_fields("60223", "mc2"))
    ticket_a, ticket_b = first.reply(a)["result"]["ticket"], second.reply(b)["result"]["ticket"]
    first.change("opened", ticket_a)
    second.change("opened", ticket_b)
    assert {e["login"] for e in first.events} == {"50112"}
    assert {e["login"] for e in second.events} == {"60223"}


def test_orders_arriving_together_are_each_executed_once_and_answered_to_their_id(acct):
    node, login = acct.client, acct.login
    ids = {node.send("open", **open_fields(login, f"mc{n}")): f"mc{n}" for n in range(12)}
    held = {}
    for request_id, comment in ids.items():
        reply = node.reply(request_id)
        assert reply["ok"], reply
        held[reply["result"]["ticket"]] = comment
    positions = {p["ticket"]: p["comment"]
                 for p in node.result("positions", login=login)["positions"]}
    assert positions == held  # every reply names the position its own order opened
    assert acct.sends() == 12
    opened = [e for e in node.events if e["change"] == "opened"]
    assert sorted(e["position"]["ticket"] for e in opened) == sorted(held)
