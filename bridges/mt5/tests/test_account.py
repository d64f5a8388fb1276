"""login, account figures, symbols, and which accounts a terminal serves."""

import time


def test_login_answers_the_account_figures_with_no_fence(acct):
    acct.fake.set_account(acct.login, balance=12345.67, currency="EUR")
    result = acct.bridge.client().login(acct.login, "secret", fence=4711)
    assert result["balance"] == 12345.67
    assert result["equity"] == 12345.67
    assert result["currency"] == "EUR"
    assert result["fence"] is None  # the bridge holds no fence
    assert isinstance(result["server_time_ms"], int)


def test_account_figures_follow_open_positions(acct):
    node, login = acct.client, acct.login
    node.result("open", login=login, fence=1, symbol="EURUSD", side="buy", volume=1.0,
                sl=None, tp=None, magic=5, comment="mc9", client_order_id="o")
    acct.fake.set_price("EURUSD", 1.10100)
    account = node.result("account", login=login)
    assert account["balance"] == 10000.0
    # Bought at the ask (1.10002), valued at the bid (1.10100): 98 points of 1 lot.
    assert round(account["equity"] - account["balance"], 2) == 98.0
    assert account["currency"] == "USD"


def test_the_server_clock_is_the_terminals(acct):
    two_hours = 2 * 3600 * 1000
    with acct.fake._edit() as state:
        state["utc_offset_ms"] = two_hours
    server = acct.client.result("account", login=acct.login)["server_time_ms"]
    assert abs(server - (time.time() * 1000 + two_hours)) < 5000


def test_a_wrong_password_is_refused_as_invalid_credentials(shared):
    error = shared.client().error("login", login=next(shared.pool), password="wrong", fence=1)
    assert error["kind"] == "rejected"
    assert error["code"] == "invalid_credentials"


def test_a_login_no_terminal_serves_is_unknown_login(shared):
    client = shared.client()
    error = client.error("login", login="777", fence=1)
    assert error["code"] == "unknown_login"
    assert client.error("positions", login="777")["code"] == "unknown_login"


def test_a_terminal_with_two_logins_switches_accounts_on_request(acct):
    other = next(acct.bridge.pool)
    acct.fake.set_account(other, password="other", balance=500.0)
    client = acct.bridge.client()
    assert client.login(other, "other")["balance"] == 500.0
    assert acct.fake.active_login() == int(other)
    # The first account again, without a password: the one it logged in with before.
    assert client.login(acct.login)["balance"] == 10000.0
    assert acct.fake.active_login() == int(acct.login)
    # Requests follow their login, switching the terminal as they go.
    assert client.result("account", login=other)["balance"] == 500.0
    assert client.result("account", login=acct.login)["balance"] == 10000.0


def test_netting_accounts_are_refused_unless_allowed(shared, make_bridge):
    login = next(shared.pool)
    shared.fake().set_account(login, margin_mode=0)
    error = shared.client().error("login", login=login, password="secret", fence=1)
    assert error["code"] == "rejected" and "hedging" in error["reason"]
    allowed = make_bridge({"t1": {"50112": {"margin_mode": 0}}}, allow_netting=True)
    assert allowed.client().login("50112", "secret")["balance"] == 10000.0


def test_symbols_carry_volume_step_minimum_maximum_and_contract_size(acct):
    with acct.fake._edit() as state:
        state["symbols"]["XAUUSD"].update(volume_step=0.1, volume_min=0.1, volume_max=50.0)
    symbols = {s["symbol"]: s for s in acct.client.result("symbols")["symbols"]}
    assert set(symbols) == {"EURUSD", "GBPUSD", "USDJPY", "XAUUSD"}
    gold = symbols["XAUUSD"]
    assert gold == {"symbol": "XAUUSD", "price": 2000.0, "volume_step": 0.1,
                    "volume_min": 0.1, "volume_max": 50.0, "contract_size": 100.0,
                    "point": 0.01, "profit_currency": "USD"}
    assert symbols["EURUSD"]["contract_size"] == 100000.0
    assert symbols["USDJPY"]["profit_currency"] == "JPY"


def test_symbols_can_be_narrowed_by_an_mt5_group(make_bridge):
    bridge = make_bridge(symbols_group="*USD*,!XAU*")
    names = {s["symbol"] for s in bridge.session().result("symbols")["symbols"]}
    assert names == {"EURUSD", "GBPUSD", "USDJPY"}


def test_logout_ends_the_stream_of_that_account(acct):
    watcher = acct.bridge.session(acct.login)
    assert acct.client.result("logout", login=acct.login) == {}
    ticket = acct.fake.manual_open(acct.login, "EURUSD", "buy", 0.1)
    watcher.change("opened", ticket)
    assert not [e for e in acct.client.events if e["change"] == "opened"]


def test_a_terminal_on_no_account_logs_in_on_the_first_request(acct):
    with acct.fake._edit() as state:
        state["active_login"] = None
    other = next(acct.bridge.pool)
    client = acct.bridge.client()
    assert client.login(other, "secret")["balance"] == 10000.0
    assert acct.fake.active_login() == int(other)
