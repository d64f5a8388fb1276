"""The named tuples the MetaTrader5 package returns, with the field names and order of
MetaQuotes' Python documentation (the examples print them with `_asdict()`).

A bridge that reads a field the real structure does not have would pass against a fake with a
made-up field and fail on a real terminal, so the fake builds every structure from these lists
only, filling the fields it does not model with the real package's zero values.
"""

from collections import namedtuple

ACCOUNT_INFO_FIELDS = (
    "login trade_mode leverage limit_orders margin_so_mode trade_allowed trade_expert "
    "margin_mode currency_digits fifo_close balance credit profit equity margin margin_free "
    "margin_level margin_so_call margin_so_so margin_initial margin_maintenance assets "
    "liabilities commission_blocked name server currency company"
).split()

SYMBOL_INFO_FIELDS = (
    "custom chart_mode select visible session_deals session_buy_orders session_sell_orders "
    "volume volumehigh volumelow time digits spread spread_float ticks_bookdepth "
    "trade_calc_mode trade_mode start_time expiration_time trade_stops_level "
    "trade_freeze_level trade_exemode swap_mode swap_rollover3days margin_hedged_use_leg "
    "expiration_mode filling_mode order_mode order_gtc_mode option_mode option_right bid "
    "bidhigh bidlow ask askhigh asklow last lasthigh lastlow volume_real volumehigh_real "
    "volumelow_real option_strike point trade_tick_value trade_tick_value_profit "
    "trade_tick_value_loss trade_tick_size trade_contract_size trade_accrued_interest "
    "trade_face_value trade_liquidity_rate volume_min volume_max volume_step volume_limit "
    "swap_long swap_short margin_initial margin_maintenance session_volume session_turnover "
    "session_interest session_buy_orders_volume session_sell_orders_volume session_open "
    "session_close session_aw session_price_settlement session_price_limit_min "
    "session_price_limit_max margin_hedged price_change price_volatility price_theoretical "
    "price_greeks_delta price_greeks_theta price_greeks_gamma price_greeks_vega "
    "price_greeks_rho price_greeks_omega price_sensitivity basis category currency_base "
    "currency_profit currency_margin bank description exchange formula isin name page path"
).split()

TICK_FIELDS = "time bid ask last volume time_msc flags volume_real".split()

TRADE_POSITION_FIELDS = (
    "ticket time time_msc time_update time_update_msc type magic identifier reason volume "
    "price_open sl tp price_current swap profit symbol comment external_id"
).split()

TRADE_ORDER_FIELDS = (
    "ticket time_setup time_setup_msc time_done time_done_msc time_expiration type type_time "
    "type_filling state magic position_id position_by_id reason volume_initial volume_current "
    "price_open sl tp price_current price_stoplimit symbol comment external_id"
).split()

TRADE_DEAL_FIELDS = (
    "ticket order time time_msc type entry magic position_id reason volume price commission "
    "swap profit fee symbol comment external_id"
).split()

TRADE_REQUEST_FIELDS = (
    "action magic order symbol volume price stoplimit sl tp deviation type type_filling "
    "type_time expiration comment position position_by"
).split()

ORDER_SEND_RESULT_FIELDS = (
    "retcode deal order volume price bid ask comment request_id retcode_external request"
).split()

AccountInfo = namedtuple("AccountInfo", ACCOUNT_INFO_FIELDS)
SymbolInfo = namedtuple("SymbolInfo", SYMBOL_INFO_FIELDS)
Tick = namedtuple("Tick", TICK_FIELDS)
TradePosition = namedtuple("TradePosition", TRADE_POSITION_FIELDS)
TradeOrder = namedtuple("TradeOrder", TRADE_ORDER_FIELDS)
TradeDeal = namedtuple("TradeDeal", TRADE_DEAL_FIELDS)
TradeRequest = namedtuple("TradeRequest", TRADE_REQUEST_FIELDS)
OrderSendResult = namedtuple("OrderSendResult", ORDER_SEND_RESULT_FIELDS)

_STRING_FIELDS = {
    "name", "server", "currency", "company", "symbol", "comment", "external_id", "basis",
    "category", "currency_base", "currency_profit", "currency_margin", "bank", "description",
    "exchange", "formula", "isin", "page", "path",
}
_BOOL_FIELDS = {
    "trade_allowed", "trade_expert", "fifo_close", "custom", "select", "visible",
    "spread_float", "margin_hedged_use_leg",
}


def build(cls, values: dict):
    """One structure from a dict: absent fields take the zero value of their type."""

    def zero(field):
        if field in _STRING_FIELDS:
            return ""
        if field in _BOOL_FIELDS:
            return False
        return 0

    return cls(*(values.get(f, zero(f)) for f in cls._fields))
