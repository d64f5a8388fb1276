"""hello, its features, and frames the bridge must answer `invalid` without executing anything."""

import json


def test_hello_names_the_bridge_and_lists_no_fence_and_no_dedupe(shared):
    client = shared.client(hello=False)
    result = client.hello("mt5-host-a")
    assert result["protocol"] == 1
    assert result["features"] == []
    assert "copier-mt5-bridge" in result["server"]
    assert "no fence" in result["server"] and "no dedupe" in result["server"]


def test_requests_before_hello_are_invalid(shared):
    client = shared.client(hello=False)
    error = client.error("positions", login="70001")
    assert error["kind"] == "invalid"
    assert "hello" in error["reason"]


def test_a_hello_of_another_protocol_version_is_invalid(shared):
    client = shared.client(hello=False)
    assert client.error("hello", client="n", protocol=2)["kind"] == "invalid"
    assert client.error("hello", client=" ", protocol=1)["kind"] == "invalid"


def test_the_fence_request_is_invalid_since_no_fence_is_kept(acct):
    error = acct.client.error("fence", login=acct.login, fence=12)
    assert error["kind"] == "invalid"
    assert error["code"] == "invalid_request"


def test_orders_of_any_fence_pass_since_the_bridge_checks_none(acct):
    client = acct.bridge.client()
    assert client.login(acct.login, "secret", fence=11)["fence"] is None
    low = client.result("open", login=acct.login, fence=3, symbol="EURUSD", side="buy",
                        volume=0.01, sl=None, tp=None, magic=1, comment="mc1",
                        client_order_id="c1")
    assert low["ticket"] > 0


def test_a_repeated_client_order_id_is_executed_again(acct):
    fields = dict(login=acct.login, fence=3, symbol="EURUSD", side="buy", volume=0.01,
                  sl=None, tp=None, magic=1, comment="mc1", client_order_id="same")
    first = acct.client.result("open", **fields)
    second = acct.client.result("open", **fields)
    assert first["ticket"] != second["ticket"] and not second["duplicate"]
    assert acct.sends() == 2


def test_malformed_and_unknown_frames_are_invalid_and_keep_the_connection(acct):
    client, login = acct.client, acct.login
    client.send_raw("{not json")
    assert client.reply(0)["error"]["kind"] == "invalid"
    for frame, needle in [
        ({"id": 107, "op": "teleport", "login": login}, "unknown op"),
        ({"id": 108, "op": "open", "login": login}, "needs"),
        ({"id": 109, "op": "close", "login": login, "ticket": "x"}, "ticket"),
        ({"id": 110, "op": "open", "login": login, "symbol": "EURUSD", "side": "long",
          "volume": 1, "magic": 1, "comment": ""}, "side"),
        # The simulated broker's test switches are not part of what a bridge implements.
        ({"id": 111, "op": "refuse", "login": login, "order": "open", "count": 1,
          "reason": "x"}, "unknown op"),
    ]:
        client.send_raw(json.dumps(frame))
        error = client.reply(frame["id"])["error"]
        assert error["kind"] == "invalid" and needle in error["reason"], error
    assert client.result("positions", login=login) == {"positions": []}
    assert acct.sends() == 0


def test_a_line_over_64_kib_is_refused(shared):
    client = shared.client()
    client.send_raw(json.dumps({"id": 5, "op": "positions", "login": "x" * 70000}))
    assert client.reply(0)["error"]["reason"] == "request line too long"


def test_replies_carry_the_request_id_when_pipelined(acct):
    ids = [acct.client.send("account", login=acct.login) for _ in range(20)]
    for request_id in ids:
        assert acct.client.reply(request_id)["ok"] is True
