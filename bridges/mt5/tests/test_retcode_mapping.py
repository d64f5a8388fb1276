"""Every trade server return code of MetaQuotes' table, end to end: injected into the fake
terminal's next `order_send`, and read back as the protocol's outcome of an `open`."""

import MetaTrader5 as mt5
import pytest

from conftest import LOGIN, start_bridge
from copier_mt5_bridge import retcodes


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One bridge for the whole table: each case injects its own code before its one order."""
    bridge = start_bridge(tmp_path_factory.mktemp("retcodes") / "bridge")
    yield bridge
    bridge.stop(wait=False)


def open_once(bridge, retcode: int, execute: bool = False):
    bridge.fake().inject_retcode(retcode, action=mt5.TRADE_ACTION_DEAL, execute=execute)
    client = bridge.session()
    before = bridge.fake().order_send_count()
    request_id = client.send("open", login=LOGIN, fence=1, symbol="EURUSD", side="buy",
                             volume=0.02, sl=None, tp=None, magic=9, comment=f"mc{retcode}",
                             client_order_id=f"rc{retcode}")
    return client, request_id, before


REFUSALS = sorted(code for code, entry in retcodes.TABLE.items()
                  if entry.outcome not in (retcodes.SUCCESS, retcodes.UNKNOWN))


@pytest.mark.parametrize("retcode", REFUSALS)
def test_a_refusal_maps_to_its_code_and_is_sent_once(shared, retcode):
    client, request_id, before = open_once(shared, retcode)
    reply = client.reply(request_id)
    assert reply["ok"] is False
    error = reply["error"]
    assert error["kind"] == "rejected"
    assert error["code"] == retcodes.TABLE[retcode].outcome
    assert str(retcode) in error["reason"] and retcodes.TABLE[retcode].name in error["reason"]
    # Never retried by the bridge, whatever the code says about trying again.
    assert shared.fake().order_send_count() == before + 1
    assert not [p for p in shared.fake().positions(LOGIN) if p["comment"] == f"mc{retcode}"]


def test_the_refusal_codes_the_node_knows(shared):
    expected = {10004: "requote", 10006: "rejected", 10014: "invalid_volume",
                10016: "invalid_stops", 10018: "market_closed", 10019: "no_money",
                10027: "rejected", 10036: "unknown_ticket", 10038: "invalid_volume"}
    for code, outcome in expected.items():
        assert retcodes.TABLE[code].outcome == outcome, code


@pytest.mark.parametrize("retcode", [10008, 10009])
def test_success_codes_answer_the_fill(shared, retcode):
    client, request_id, _ = open_once(shared, retcode, execute=True)
    fill = client.reply(request_id)["result"]
    held = [p for p in shared.fake().positions(LOGIN) if p["ticket"] == fill["ticket"]]
    assert held and held[0]["comment"] == f"mc{retcode}"
    assert fill["volume"] == 0.02 and fill["duplicate"] is False


def test_done_partial_answers_the_filled_volume(shared):
    client, request_id, _ = open_once(shared, 10010)
    fill = client.reply(request_id)["result"]
    assert fill["volume"] == 0.01


@pytest.mark.parametrize("retcode,execute", [(10012, False), (10012, True), (10099, True)])
def test_timeouts_and_unlisted_codes_are_unknown_outcomes(shared, retcode, execute):
    client, request_id, before = open_once(shared, retcode, execute=execute)
    assert client.unanswered(request_id, LOGIN)
    assert shared.fake().order_send_count() == before + 1
    # The connection goes on; the node looks for the order's marker, as after a lost reply.
    found = [p for p in client.result("positions", login=LOGIN)["positions"]
             if p["comment"] == f"mc{retcode}"]
    assert len(found) == (1 if execute else 0)
    for p in found:
        client.result("close", login=LOGIN, fence=1, ticket=p["ticket"], volume=None,
                      client_order_id="cleanup")
