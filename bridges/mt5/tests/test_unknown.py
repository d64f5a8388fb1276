"""Outcomes the bridge cannot know: `order_send` returning None (an IPC failure or timeout
between the worker and its terminal), and a terminal that goes away and comes back."""

import time

import MetaTrader5 as mt5

from conftest import LOGIN

MARKER = "mc2000077"


def wait_ok(client, op, **fields):
    deadline = time.monotonic() + 5
    while True:
        frame = client.call(op, **fields)
        if frame["ok"] or time.monotonic() > deadline:
            return frame
        time.sleep(0.1)


def open_request(client, login, comment=MARKER):
    return client.send("open", login=login, fence=5, symbol="EURUSD", side="buy", volume=0.3,
                       sl=None, tp=None, magic=100002, comment=comment,
                       client_order_id="l9-m2000077-open")


def test_order_send_none_is_an_unknown_outcome_and_the_marker_finds_the_position(acct):
    node, login = acct.client, acct.login
    acct.fake.lose_order_send(execute=True)
    request_id = open_request(node, login)
    # No reply: never a refusal. The node's client times out and calls the outcome unknown.
    assert node.unanswered(request_id, login)
    # Resolved as the node does: by the order's marker in the positions, not executed twice.
    found = [p for p in node.result("positions", login=login)["positions"]
             if (p["magic"], p["comment"]) == (100002, MARKER)]
    assert len(found) == 1 and found[0]["volume"] == 0.3
    assert acct.sends() == 1  # the bridge did not retry on its own
    # The stream told of it all the same.
    assert node.change("opened", found[0]["ticket"])["position"]["comment"] == MARKER


def test_order_send_none_without_execution_leaves_nothing_behind(acct):
    node, login = acct.client, acct.login
    acct.fake.lose_order_send(execute=False)
    request_id = open_request(node, login)
    assert node.unanswered(request_id, login)
    assert node.result("positions", login=login) == {"positions": []}
    assert acct.sends() == 1
    # The worker took the lost link for a terminal gone away, and is back at once.
    assert wait_ok(node, "account", login=login)["result"]["balance"] == 10000.0


def test_a_lost_close_is_unknown_and_the_history_tells(acct):
    node, login = acct.client, acct.login
    ticket = node.result("open", login=login, fence=5, symbol="EURUSD", side="buy", volume=0.3,
                         sl=None, tp=None, magic=100002, comment=MARKER,
                         client_order_id="o")["ticket"]
    acct.fake.lose_order_send(execute=True, action=mt5.TRADE_ACTION_DEAL)
    request_id = node.send("close", login=login, fence=5, ticket=ticket, volume=None,
                           client_order_id="c")
    assert node.unanswered(request_id, login)
    (closed,) = wait_ok(node, "history", login=login)["result"]["history"]
    assert (closed["ticket"], closed["comment"], closed["remaining_volume"]) == (ticket, MARKER,
                                                                                 0.0)


def test_a_disconnected_terminal_refuses_orders_unsent_and_reads(node, bridge):
    fake = bridge.fake()
    fake.disconnect()
    error = node.error("open", login=LOGIN, fence=5, symbol="EURUSD", side="buy", volume=0.1,
                       sl=None, tp=None, magic=1, comment="mc1", client_order_id="x")
    # Nothing was sent: refused as "not now", which the node tries again later.
    assert error["code"] == "market_closed" and "terminal unavailable" in error["reason"]
    assert fake.order_send_count() == 0
    for read in ("positions", "orders", "history", "account"):
        error = node.error(read, login=LOGIN)
        # Never `invalid`: an invalid answer to `orders` would read as "no pending orders".
        assert error["kind"] == "rejected" and error["code"] == "rejected", (read, error)
    # A login gets no answer: the node's client retries it as a broker it cannot reach.
    request_id = node.send("login", login=LOGIN, password="secret", fence=5)
    assert node.unanswered(request_id, LOGIN)


def test_the_terminal_coming_back_is_picked_up_and_missed_changes_are_streamed(node, bridge):
    fake = bridge.fake()
    ticket = node.result("open", login=LOGIN, fence=5, symbol="EURUSD", side="buy", volume=0.3,
                         sl=None, tp=None, magic=7, comment=MARKER,
                         client_order_id="o")["ticket"]
    fake.disconnect()
    time.sleep(0.3)
    # Meanwhile a person closes part of it in the terminal, which restarts.
    with fake._edit() as state:
        state["connected"] = True
    fake.manual_close(LOGIN, ticket, 0.1)
    with fake._edit() as state:
        state["connected"] = False
    fake.reconnect()
    event = node.change("partially_closed", ticket)
    assert event["closed"]["closed_by"] == "manual" and event["closed"]["volume"] == 0.1
    assert event["position"]["comment"] == MARKER
    assert wait_ok(node, "positions", login=LOGIN)["result"]["positions"][0]["volume"] == 0.2


def test_a_hung_terminal_refuses_reads_until_it_answers_again(node, bridge):
    bridge.fake().ipc_timeouts(10**6)
    first = node.call("positions", login=LOGIN)
    assert first["ok"] is False and "terminal unavailable" in first["error"]["reason"]
    bridge.fake().ipc_timeouts(0)
    assert wait_ok(node, "positions", login=LOGIN)["result"] == {"positions": []}


def test_a_worker_that_dies_is_restarted_and_its_connections_closed(bridge):
    import os
    import signal

    node = bridge.session()
    bystander = bridge.client()  # logged nothing in: keeps its connection
    (worker,) = bridge.workers()
    os.kill(worker, signal.SIGKILL)
    # The node hears of it as of any lost connection, and logs in again to catch up.
    assert node._wait(lambda: True if node.closed else None, 5)
    again = bridge.session()
    fill = again.result("open", login=LOGIN, fence=5, symbol="EURUSD", side="buy",
                        volume=0.1, sl=None, tp=None, magic=1, comment="mc1",
                        client_order_id="after")
    assert again.change("opened", fill["ticket"])
    assert bridge.workers() != [worker]
    assert bystander.result("symbols")["symbols"]
