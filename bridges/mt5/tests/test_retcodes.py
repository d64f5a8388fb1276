"""The retcode table against MetaQuotes' documented codes (the fake's constants)."""

import MetaTrader5 as mt5

from copier_mt5_bridge import retcodes, wire

PROTOCOL_CODES = {wire.UNKNOWN_SYMBOL, wire.INVALID_VOLUME, wire.INVALID_STOPS, wire.SLIPPAGE,
                  wire.REQUOTE, wire.MARKET_CLOSED, wire.NO_MONEY, wire.UNKNOWN_TICKET,
                  wire.REJECTED}


def test_every_documented_return_code_is_in_the_table_under_its_name():
    documented = {getattr(mt5, n): n for n in dir(mt5) if n.startswith("TRADE_RETCODE_")}
    assert set(documented) == set(retcodes.TABLE)
    for code, name in documented.items():
        assert retcodes.TABLE[code].name == name


def test_only_placed_done_and_partial_are_successes_and_timeout_is_unknown():
    successes = {c for c, e in retcodes.TABLE.items() if e.outcome == retcodes.SUCCESS}
    assert successes == {10008, 10009, 10010}
    unknown = {c for c, e in retcodes.TABLE.items() if e.outcome == retcodes.UNKNOWN}
    assert unknown == {10012}
    assert retcodes.classify(10999).outcome == retcodes.UNKNOWN
    for entry in retcodes.TABLE.values():
        assert entry.outcome in PROTOCOL_CODES | {retcodes.SUCCESS, retcodes.UNKNOWN}
