"""The fake `MetaTrader5` module keeps to MetaQuotes' documented API: a double that drifted
from it would let the bridge pass here and fail on a terminal."""

import MetaTrader5 as mt5
import pytest
from MetaTrader5.control import FakeTerminal


@pytest.fixture
def terminal(tmp_path):
    fake = FakeTerminal(tmp_path / "mt5" / "terminal64.exe").create({"1001": {}},
                                                                    active_login="1001")
    assert mt5.initialize(path=str(fake.path))
    yield fake
    mt5.shutdown()


def test_structures_have_the_documented_fields(terminal):
    assert mt5.TradePosition._fields[:4] == ("ticket", "time", "time_msc", "time_update")
    assert "identifier" in mt5.TradePosition._fields
    assert {"entry", "position_id", "reason"} <= set(mt5.TradeDeal._fields)
    assert {"retcode", "deal", "order", "volume", "price", "request"} <= set(
        mt5.OrderSendResult._fields)
    info = mt5.symbol_info("EURUSD")
    assert (info.volume_step, info.trade_contract_size, info.name) == (0.01, 100000.0, "EURUSD")
    assert mt5.account_info().margin_mode == mt5.ACCOUNT_MARGIN_MODE_RETAIL_HEDGING


def test_constants_have_the_documented_values():
    assert (mt5.TRADE_ACTION_DEAL, mt5.TRADE_ACTION_PENDING, mt5.TRADE_ACTION_SLTP,
            mt5.TRADE_ACTION_MODIFY, mt5.TRADE_ACTION_REMOVE) == (1, 5, 6, 7, 8)
    assert (mt5.DEAL_ENTRY_IN, mt5.DEAL_ENTRY_OUT, mt5.DEAL_ENTRY_OUT_BY) == (0, 1, 3)
    assert (mt5.TRADE_RETCODE_DONE, mt5.TRADE_RETCODE_PLACED,
            mt5.TRADE_RETCODE_CLIENT_DISABLES_AT) == (10009, 10008, 10027)
    assert mt5.RES_E_INTERNAL_FAIL_TIMEOUT == -10005


def test_comments_are_cut_to_31_characters_as_the_terminal_does(terminal):
    result = mt5.order_send({"action": mt5.TRADE_ACTION_DEAL, "symbol": "EURUSD", "volume": 0.1,
                             "type": mt5.ORDER_TYPE_BUY, "comment": "x" * 40, "magic": 3})
    assert result.retcode == mt5.TRADE_RETCODE_DONE
    (position,) = mt5.positions_get()
    assert position.comment == "x" * 31 and position.magic == 3


def test_a_partial_close_keeps_the_ticket_on_a_hedging_account(terminal):
    opened = mt5.order_send({"action": mt5.TRADE_ACTION_DEAL, "symbol": "EURUSD", "volume": 0.3,
                             "type": mt5.ORDER_TYPE_SELL})
    mt5.order_send({"action": mt5.TRADE_ACTION_DEAL, "symbol": "EURUSD", "volume": 0.1,
                    "type": mt5.ORDER_TYPE_BUY, "position": opened.order})
    (position,) = mt5.positions_get()
    assert (position.ticket, position.volume) == (opened.order, 0.2)
    entries = [d.entry for d in mt5.history_deals_get(position=opened.order)]
    assert entries == [mt5.DEAL_ENTRY_IN, mt5.DEAL_ENTRY_OUT]


def test_a_lost_terminal_answers_none_and_an_ipc_error(terminal):
    terminal.disconnect()
    assert mt5.positions_get() is None
    assert mt5.last_error()[0] == mt5.RES_E_INTERNAL_FAIL_CONNECT
    terminal.reconnect()
    assert mt5.positions_get() is None  # a restarted terminal needs initialize again
    assert mt5.initialize(path=str(terminal.path))
    assert mt5.positions_get() == ()


def test_injected_faults(terminal):
    terminal.inject_retcode(mt5.TRADE_RETCODE_MARKET_CLOSED)
    request = {"action": mt5.TRADE_ACTION_DEAL, "symbol": "EURUSD", "volume": 0.1,
               "type": mt5.ORDER_TYPE_BUY}
    assert mt5.order_send(request).retcode == mt5.TRADE_RETCODE_MARKET_CLOSED
    terminal.lose_order_send(execute=True)
    assert mt5.order_send(request) is None
    assert mt5.last_error()[0] == mt5.RES_E_INTERNAL_FAIL_TIMEOUT
    assert len(mt5.positions_get()) == 1 and terminal.order_send_count() == 2
