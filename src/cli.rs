//! The command line (docs/cli.md). Flag values stay text here and are parsed with the other
//! configuration layers, so a bad flag gets the same located error as a bad file entry.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::db::copy::Role;
use crate::model::link::{LotMode, OnRemove, PendingOrders, Sides};
use crate::model::named::Named;
use crate::model::risk::{Basis, Period, RiskAction};

#[derive(Debug, Parser)]
#[command(
    name = "copier-node",
    version,
    about = "Node daemon of a cloud trade copier: holds broker sessions under database leases"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the node daemon.
    Run(Box<RunArgs>),
    /// Apply pending migrations and exit (safe to run from many replicas at once).
    Migrate(DbArgs),
    /// The cluster as the database sees it: nodes, accounts per node, lease expiries, unowned
    /// and disabled accounts.
    Status(StatusArgs),
    /// One command, one machine: a throwaway PostgreSQL, the simulated broker, masters with
    /// followers trading live, and node processes scaling out from one to four, the busiest
    /// killed and restarted about every 25 s; Ctrl-C runs a final check and stops everything.
    Demo(DemoArgs),
    /// The simulated trade server and its hand tools.
    #[command(subcommand)]
    SimBroker(SimBrokerCommand),
    /// Broker credentials encrypted at rest: make a key, encrypt a password for the
    /// `trading_accounts.credentials` column.
    #[command(subcommand)]
    Credentials(CredentialsCommand),
    /// Trading accounts without SQL: add, list, show, set, disable, remove (each change one
    /// transaction, checked as the node checks a row).
    #[command(subcommand)]
    Accounts(AccountsCommand),
    /// A follower's risk limits: add, list, reset (an operator's early reset), remove.
    #[command(subcommand)]
    Risk(RiskCommand),
    /// Copy links without SQL: add, list, show, set, remove (a link the node would refuse is
    /// refused here, naming the field).
    #[command(subcommand)]
    Links(LinksCommand),
    /// A follower's recent copies from the copy ledger: master and follower tickets, requested
    /// and filled price, slippage, and the latency by leg.
    Copies(CopiesArgs),
    /// Why a master position was or was not copied to a follower: each link's recorded
    /// decisions, the master's published position, and (FIX followers) the order ledger.
    Why(WhyArgs),
    /// Check a bridge against the bridge protocol: a scripted session on a demo account (it
    /// opens, partially closes, modifies and closes a small position of its own, places and
    /// cancels a pending order, drops a connection with an order in flight), each check passed
    /// or failed; exits 1 if any failed.
    BridgeCheck(BridgeCheckArgs),
}

#[derive(Debug, Args)]
pub struct BridgeCheckArgs {
    /// The bridge: host:port.
    #[arg(long)]
    pub server: String,
    /// A demo account's login on the bridge (the checks trade on it, under a marker of their
    /// own, and leave its other positions alone).
    #[arg(long)]
    pub login: String,
    /// Read the account's password from standard input (one line).
    #[arg(long)]
    pub password_stdin: bool,
    /// The symbol to trade (default: the first the bridge lists).
    #[arg(long)]
    pub symbol: Option<String>,
    /// Print one JSON object: the server, the login, `passed`, and each check's result.
    #[arg(long)]
    pub json: bool,
    /// The longest wait for a reply or an event, e.g. 10s or 1500ms.
    #[arg(long, default_value = "10s")]
    pub timeout: String,
}

#[derive(Debug, Args)]
pub struct CopiesArgs {
    #[command(flatten)]
    pub manage: ManageArgs,
    /// The follower account's id.
    pub follower: i64,
    /// How many copies, newest first.
    #[arg(long, default_value_t = 20)]
    pub limit: i64,
}

#[derive(Debug, Args)]
pub struct WhyArgs {
    #[command(flatten)]
    pub manage: ManageArgs,
    /// The follower account's id.
    pub follower: i64,
    /// The master position's ticket.
    pub master_ticket: i64,
}

#[derive(Debug, Subcommand)]
pub enum AccountsCommand {
    /// Add an account (its password, if any, read from standard input and stored encrypted).
    Add(AccountAddArgs),
    /// List accounts with their owner and status.
    List(AccountListArgs),
    /// One account.
    Show(AccountIdArgs),
    /// Change an account's fields.
    Set(AccountSetArgs),
    /// Disable an account (its owner releases it; nothing is deleted).
    Disable(AccountIdArgs),
    /// Delete an account: one a node trades is disabled first and deleted once released (or
    /// refused after `--wait`); one with copy links is refused.
    Remove(AccountRemoveArgs),
}

#[derive(Debug, Args)]
pub struct ManageArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// Print JSON (one object, or an array for `list`).
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct AccountFields {
    /// Platform whose nodes run the account (e.g. mt4, mt5).
    #[arg(long)]
    pub platform: Option<String>,
    /// The account's role.
    #[arg(long, long_help = Role::help())]
    pub role: Option<String>,
    /// The broker: host:port (bridge protocol) or fix://host:port?target=... (FIX 4.4).
    #[arg(long)]
    pub server: Option<String>,
    /// The login on that broker.
    #[arg(long)]
    pub login: Option<String>,
    /// Read the broker password from standard input (one line) and store it encrypted with
    /// the credentials key.
    #[arg(long)]
    pub password_stdin: bool,
    /// Secrets file holding the credentials key (or COPIER_CREDENTIALS_KEY).
    #[arg(long, value_name = "PATH")]
    pub credentials_key_file: Option<String>,
}

#[derive(Debug, Args)]
pub struct AccountAddArgs {
    #[command(flatten)]
    pub manage: ManageArgs,
    /// The account's id (the row's primary key).
    #[arg(long)]
    pub id: i64,
    #[command(flatten)]
    pub fields: AccountFields,
    /// Add it disabled (no node takes it until enabled).
    #[arg(long)]
    pub disabled: bool,
}

#[derive(Debug, Args)]
pub struct AccountListArgs {
    #[command(flatten)]
    pub manage: ManageArgs,
    /// Only this platform's accounts.
    #[arg(long)]
    pub platform: Option<String>,
}

#[derive(Debug, Subcommand)]
pub enum RiskCommand {
    /// Add a drawdown limit to a follower (one per period and basis).
    Add(RiskAddArgs),
    /// A follower's limits (every follower's without `--account`), with their state.
    List(RiskListArgs),
    /// Reset a follower's limits now (all, or `--limit`): each period starts again from the
    /// next reading, and new copies resume.
    Reset(RiskResetArgs),
    /// Remove a limit.
    Remove(RiskIdArgs),
}

#[derive(Debug, Args)]
pub struct RiskAddArgs {
    #[command(flatten)]
    pub manage: ManageArgs,
    /// The follower account's id.
    #[arg(long)]
    pub account: i64,
    /// How long the limit's period lasts (days, weeks and months of the broker's server clock).
    #[arg(long, long_help = Period::help())]
    pub period: String,
    /// What the limit watches.
    #[arg(long, long_help = Basis::help())]
    pub basis: String,
    /// The limit as a percent of the period's starting value (one of --percent, --amount).
    #[arg(long)]
    pub percent: Option<f64>,
    /// The limit in money, in the account's currency.
    #[arg(long)]
    pub amount: Option<f64>,
    /// What reaching the limit does.
    #[arg(long, default_value = "close_only", long_help = RiskAction::help())]
    pub action: String,
}

#[derive(Debug, Args)]
pub struct RiskListArgs {
    #[command(flatten)]
    pub manage: ManageArgs,
    #[arg(long)]
    pub account: Option<i64>,
}

#[derive(Debug, Args)]
pub struct RiskResetArgs {
    #[command(flatten)]
    pub manage: ManageArgs,
    /// The follower account's id.
    #[arg(long)]
    pub account: i64,
    /// Only this limit.
    #[arg(long)]
    pub limit: Option<i64>,
}

#[derive(Debug, Args)]
pub struct RiskIdArgs {
    #[command(flatten)]
    pub manage: ManageArgs,
    /// The limit's id.
    pub id: i64,
}

#[derive(Debug, Args)]
pub struct AccountIdArgs {
    #[command(flatten)]
    pub manage: ManageArgs,
    pub id: i64,
}

#[derive(Debug, Args)]
pub struct AccountSetArgs {
    #[command(flatten)]
    pub manage: ManageArgs,
    pub id: i64,
    #[command(flatten)]
    pub fields: AccountFields,
    /// true or false.
    #[arg(long)]
    pub enabled: Option<bool>,
    /// Remove the stored password (log in without one).
    #[arg(long, conflicts_with = "password_stdin")]
    pub clear_password: bool,
    /// A follower opens no copy while it holds this many open copies, whatever link they came
    /// from (`none` lifts it).
    #[arg(long, allow_hyphen_values = true)]
    pub max_open_copies: Option<String>,
}

#[derive(Debug, Args)]
pub struct AccountRemoveArgs {
    #[command(flatten)]
    pub manage: ManageArgs,
    pub id: i64,
    /// How long to wait for the owner to release an account a node trades.
    #[arg(long, default_value = "120s", value_name = "DURATION")]
    pub wait: String,
}

#[derive(Debug, Subcommand)]
pub enum LinksCommand {
    /// Add a link: the follower copies the master.
    Add(Box<LinkAddArgs>),
    /// List links.
    List(LinkListArgs),
    /// One link.
    Show(LinkIdArgs),
    /// Change a link's settings.
    Set(Box<LinkSetArgs>),
    /// Delete a link (the follower stops copying that master; its open copies stay, or are
    /// closed when the link's `on_remove` is `close`).
    Remove(LinkIdArgs),
}

/// A link's settings (defaults as the schema's when added).
#[derive(Debug, Args)]
pub struct LinkFields {
    /// How a copy's volume is computed from the master's.
    #[arg(long, long_help = LotMode::help())]
    pub lot_mode: Option<String>,
    #[arg(long, allow_hyphen_values = true)]
    pub lot_value: Option<f64>,
    /// true: copies take the opposite side.
    #[arg(long)]
    pub reverse: Option<bool>,
    #[arg(long)]
    pub copy_sl_tp: Option<bool>,
    /// JSON object of master symbol -> follower symbol.
    #[arg(long)]
    pub symbol_map: Option<String>,
    /// true: also copy positions open when the link was made.
    #[arg(long)]
    pub copy_existing: Option<bool>,
    #[arg(long)]
    pub enabled: Option<bool>,
    /// Only these master symbols (comma-separated; `all` lifts the filter).
    #[arg(long)]
    pub symbols: Option<String>,
    /// Only master positions with these magic numbers (comma-separated; `all` lifts it).
    #[arg(long)]
    pub magics: Option<String>,
    /// Which of the master's sides the link copies (before `reverse`).
    #[arg(long, long_help = Sides::help())]
    pub sides: Option<String>,
    #[arg(long)]
    pub close_only: Option<bool>,
    /// Largest copy in lots (`none` lifts it; the same for the limits below).
    #[arg(long, allow_hyphen_values = true)]
    pub max_lot: Option<String>,
    #[arg(long, allow_hyphen_values = true)]
    pub max_delay_ms: Option<String>,
    #[arg(long, allow_hyphen_values = true)]
    pub max_slippage: Option<String>,
    #[arg(long, allow_hyphen_values = true)]
    pub equity_stop: Option<String>,
    /// Copy the stop loss (needs --copy-sl-tp true).
    #[arg(long)]
    pub copy_sl: Option<bool>,
    /// Copy the take profit (needs --copy-sl-tp true).
    #[arg(long)]
    pub copy_tp: Option<bool>,
    /// The farthest a copy's stop loss may be from the master's open price (price units).
    #[arg(long, allow_hyphen_values = true)]
    pub max_sl_distance: Option<String>,
    /// true: a copy below the broker's minimum lot opens at the minimum instead of being skipped.
    #[arg(long)]
    pub use_min_lot: Option<bool>,
    /// Master positions smaller than this many lots are not copied.
    #[arg(long, allow_hyphen_values = true)]
    pub min_master_lot: Option<String>,
    /// The link opens no copy while it holds this many open copies.
    #[arg(long, allow_hyphen_values = true)]
    pub max_open_copies: Option<String>,
    /// A fixed stop loss this many points from the copy's open price, instead of the master's
    /// (points of the follower's symbol: 0.00001 on a five-digit EURUSD).
    #[arg(long, allow_hyphen_values = true)]
    pub sl_points: Option<String>,
    /// A fixed take profit this many points from the copy's open price, instead of the master's.
    #[arg(long, allow_hyphen_values = true)]
    pub tp_points: Option<String>,
    /// What removing the link does to its open copies (default `leave`).
    #[arg(long, long_help = OnRemove::help())]
    pub on_remove: Option<String>,
    /// How the master's pending (limit and stop) orders are copied (default `copy`).
    #[arg(long, long_help = PendingOrders::help())]
    pub pending_orders: Option<String>,
}

#[derive(Debug, Args)]
pub struct LinkAddArgs {
    #[command(flatten)]
    pub manage: ManageArgs,
    #[arg(long)]
    pub master: i64,
    #[arg(long)]
    pub follower: i64,
    #[command(flatten)]
    pub fields: LinkFields,
}

#[derive(Debug, Args)]
pub struct LinkListArgs {
    #[command(flatten)]
    pub manage: ManageArgs,
    #[arg(long)]
    pub master: Option<i64>,
    #[arg(long)]
    pub follower: Option<i64>,
}

#[derive(Debug, Args)]
pub struct LinkIdArgs {
    #[command(flatten)]
    pub manage: ManageArgs,
    pub id: i64,
}

#[derive(Debug, Args)]
pub struct LinkSetArgs {
    #[command(flatten)]
    pub manage: ManageArgs,
    pub id: i64,
    #[command(flatten)]
    pub fields: LinkFields,
}

#[derive(Debug, Subcommand)]
pub enum CredentialsCommand {
    /// Print a new random credentials key (base64 of 32 bytes) for COPIER_CREDENTIALS_KEY or a
    /// secrets file named by `credentials_key_file`.
    Keygen,
    /// Read a password from standard input (one line) and print the value to store in
    /// `trading_accounts.credentials`, encrypted with the configured credentials key.
    Encrypt(KeyArgs),
    /// Re-encrypt every stored value with the current (first) credentials key: run it after
    /// putting a new key first (`COPIER_CREDENTIALS_KEY=new,old`) on every replica, then drop the
    /// old key. Prints what it did; exits 1 if a value could not be read.
    Rotate(RotateArgs),
}

#[derive(Debug, Args)]
pub struct RotateArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// Secrets file holding the credentials keys (new first).
    #[arg(long, value_name = "PATH")]
    pub credentials_key_file: Option<String>,
    /// Also encrypt values stored in plaintext (from before encryption at rest).
    #[arg(long)]
    pub encrypt_plaintext: bool,
}

/// Where the credentials key comes from (besides COPIER_CREDENTIALS_KEY in the environment).
#[derive(Debug, Args)]
pub struct KeyArgs {
    /// TOML configuration file (only `credentials_key_file` is read from it).
    #[arg(long, value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// Secrets file holding the credentials key (base64 of 32 bytes).
    #[arg(long, value_name = "PATH")]
    pub credentials_key_file: Option<String>,
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// Print exactly one JSON document.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Stop after this long (e.g. `60s`); otherwise run until Ctrl-C.
    #[arg(long, value_name = "DURATION")]
    pub duration: Option<String>,
    /// End with one JSON summary line (copies, duplicates, failovers, ...).
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum SimBrokerCommand {
    /// Run the simulated trade server.
    Serve(ServeArgs),
    /// Open, close or modify a trade, or place, amend or cancel a pending order, by hand (client
    /// `manual`, no fence).
    Trade(TradeArgs),
    /// Print the account's open positions as JSON lines.
    Positions(AccountArgs),
    /// Print the account's closed positions (every full or partial close) as JSON lines.
    History(AccountArgs),
    /// Print the account's pending orders as JSON lines.
    Orders(AccountArgs),
    /// Set a symbol's price now (with `--variants`, of a base symbol and its suffixed variants:
    /// `EURUSD` moves `EURUSD.m` too); prints the symbols it moved. Stops and pending orders it
    /// reaches fill.
    Price(PriceArgs),
}

#[derive(Debug, Args)]
pub struct PriceArgs {
    /// The simulated broker, host:port.
    #[arg(long, value_name = "ADDR")]
    pub broker: String,
    pub symbol: String,
    pub price: f64,
    /// Move every suffixed variant of SYMBOL (a base symbol) too.
    #[arg(long)]
    pub variants: bool,
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Address to listen on (`127.0.0.1:0` picks a free port, logged).
    #[arg(long, value_name = "ADDR")]
    pub listen: String,
    /// Journal file: one JSON line per order request and login, appended.
    #[arg(long, value_name = "PATH")]
    pub journal: std::path::PathBuf,
    /// Keep accounts, positions, history and fences across restarts in this file.
    #[arg(long, value_name = "PATH")]
    pub state: Option<std::path::PathBuf>,
    /// Accept stale fences (to measure what the fence check prevents).
    #[arg(long)]
    pub no_fence_check: bool,
    /// Execute every request, even one whose client order id was already executed (MT4/MT5
    /// servers deduplicate nothing).
    #[arg(long)]
    pub no_dedupe: bool,
    /// Answer `fence` requests as a bridge that predates them (`invalid`, and not listed in
    /// `hello`): nodes then hand accounts off without preparing the new owner's login.
    #[arg(long)]
    pub no_fence_request: bool,
    /// How long each login takes before it is answered, e.g. `300ms` (a real trade server's
    /// login takes hundreds of milliseconds); other requests are not held up by it.
    #[arg(long, value_name = "DURATION", default_value = "0s")]
    pub login_delay: String,
    /// How long each read (positions, history, pending orders, account, symbols) takes before
    /// it is answered, e.g. `200ms` (a slow trade server); other requests are not held up by it.
    #[arg(long, value_name = "DURATION", default_value = "0s")]
    pub read_delay: String,
    /// Answer a delayed read with the account as it was when the read was asked, as a real
    /// trade server's reply is its state when it took the request (by default, as it is when
    /// answered).
    #[arg(long)]
    pub reads_as_of_request: bool,
    /// Journal every read too (`action` the read: `positions`, `history`, `orders`, `account`,
    /// or `symbols` with an empty `login`), to tell from the journal alone what a client read.
    #[arg(long)]
    pub journal_reads: bool,
    /// Send each reply before the position updates it caused (the bridge protocol allows either
    /// order; by default updates go first).
    #[arg(long)]
    pub reply_first: bool,
    /// Behave as MT4 servers do: a partial close gives the remainder a new ticket and rewrites
    /// comments (`from #<old>` on the remainder, `to #<new>` on the closed part, the magic
    /// kept); a stop-loss or take-profit close rewrites the history entry's comment (`[sl]`,
    /// `[tp]`).
    #[arg(long)]
    pub mt4: bool,
    /// Balance of a new account.
    #[arg(long, default_value_t = 10_000.0)]
    pub balance: f64,
    /// Move prices along a deterministic walk every DURATION and trigger stop loss and take
    /// profit (e.g. `100ms`). Prices stay fixed without it.
    #[arg(long, value_name = "DURATION")]
    pub price_walk: Option<String>,
    /// List the default symbols under this suffix (repeat for several; `""` is the bare
    /// name). Default: bare and `.m`.
    #[arg(long, value_name = "SUFFIX")]
    pub symbol_suffix: Vec<String>,
    /// Units per lot of a base symbol, e.g. `XAUUSD=10` (repeat for several).
    #[arg(long, value_name = "SYMBOL=UNITS")]
    pub contract_size: Vec<String>,
    /// The currency of an account, e.g. `2001=EUR` (repeat for several; default USD): its
    /// balance, equity and profits count in it, converted at the market's prices.
    #[arg(long, value_name = "LOGIN=CURRENCY")]
    pub currency: Vec<String>,
    /// Daily trading sessions of a base symbol on UTC, e.g.
    /// `XAUUSD=01:00-23:00` or `US30=13:30-20:00,21:00-22:00` (repeat for several; others trade
    /// around the clock). Outside them orders on it are refused with `market closed`.
    #[arg(long, value_name = "SYMBOL=HH:MM-HH:MM[,...]")]
    pub session: Vec<String>,
    /// The server's clock as an offset from UTC, e.g. `+02:00` (MT servers keep their own time
    /// zone): the server time accounts show, and the clock pending orders' expiries are on.
    /// Trading sessions stay on UTC.
    #[arg(
        long,
        value_name = "[+-]HH:MM",
        default_value = "+00:00",
        allow_hyphen_values = true
    )]
    pub utc_offset: String,
}

#[derive(Debug, Args)]
pub struct AccountArgs {
    /// The simulated broker, host:port.
    #[arg(long, value_name = "ADDR")]
    pub broker: String,
    /// The account's login.
    #[arg(long)]
    pub login: String,
}

#[derive(Debug, Args)]
pub struct TradeArgs {
    #[command(flatten)]
    pub account: AccountArgs,
    #[command(subcommand)]
    pub action: TradeAction,
}

#[derive(Debug, Subcommand)]
pub enum TradeAction {
    /// Open a market position; prints the new ticket.
    Open {
        symbol: String,
        /// buy or sell
        side: String,
        volume: f64,
        #[arg(long)]
        sl: Option<f64>,
        #[arg(long)]
        tp: Option<f64>,
        #[arg(long, default_value_t = 0)]
        magic: i64,
        #[arg(long, default_value = "")]
        comment: String,
    },
    /// Close all of a position, or `--volume` of it.
    Close {
        ticket: i64,
        #[arg(long)]
        volume: Option<f64>,
    },
    /// Set a position's stop loss and take profit (omit one to remove it).
    Modify {
        ticket: i64,
        #[arg(long)]
        sl: Option<f64>,
        #[arg(long)]
        tp: Option<f64>,
    },
    /// Place a pending order; prints its ticket. A limit waits below the market (buy) or above
    /// (sell), a stop beyond it; it fills as the price reaches it.
    Place {
        symbol: String,
        /// buy or sell
        side: String,
        /// limit or stop
        kind: String,
        price: f64,
        volume: f64,
        #[arg(long)]
        sl: Option<f64>,
        #[arg(long)]
        tp: Option<f64>,
        /// When it expires, Unix milliseconds on the server's clock (default: good till
        /// cancelled).
        #[arg(long)]
        expiry_ms: Option<i64>,
        #[arg(long, default_value_t = 0)]
        magic: i64,
        #[arg(long, default_value = "")]
        comment: String,
    },
    /// Change a pending order's price, stops and expiry (omit one to remove it).
    Amend {
        ticket: i64,
        #[arg(long)]
        price: f64,
        #[arg(long)]
        sl: Option<f64>,
        #[arg(long)]
        tp: Option<f64>,
        #[arg(long)]
        expiry_ms: Option<i64>,
    },
    /// Cancel a pending order.
    Cancel { ticket: i64 },
}

/// Flags every command that touches the database takes.
#[derive(Debug, Args)]
pub struct DbArgs {
    /// TOML configuration file.
    #[arg(long, value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// PostgreSQL connection string (prefer DATABASE_URL or COPIER_DATABASE_URL in production).
    #[arg(long, value_name = "URL")]
    pub database_url: Option<String>,
}

impl DbArgs {
    pub fn flags(&self) -> Vec<(&'static str, Option<String>)> {
        vec![("database_url", self.database_url.clone())]
    }
}

#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// The platform this node serves, e.g. mt5 (required: here, as COPIER_PLATFORM, or as
    /// `platform` in the file).
    #[arg(long, value_name = "PLATFORM")]
    pub platform: Option<String>,
    /// This node's identity (default <platform>-<hostname>).
    #[arg(long)]
    pub node_id: Option<String>,
    /// Most accounts this node owns (default 100).
    #[arg(long)]
    pub capacity: Option<String>,
    /// Lease length written to the database (default 60s).
    #[arg(long)]
    pub lease: Option<String>,
    /// How much earlier than the lease the node stops trusting it (default 15s).
    #[arg(long)]
    pub fence: Option<String>,
    /// Period of the lease cycle (default 20s).
    #[arg(long)]
    pub cycle: Option<String>,
    /// Health and metrics endpoint (default 0.0.0.0:9464).
    #[arg(long)]
    pub http_listen: Option<String>,
    /// text or json (default text).
    #[arg(long)]
    pub log_format: Option<String>,
    /// Direct connection for LISTEN (default: database_url).
    #[arg(long, value_name = "URL")]
    pub listen_database_url: Option<String>,
    /// Learn of master events by polling the database this often instead of LISTEN, e.g.
    /// `100ms` (for transaction poolers and engines without LISTEN; default off).
    #[arg(long, value_name = "DURATION")]
    pub events_poll: Option<String>,
    /// `session` or `transaction`: the mode of the PgBouncer between the node and PostgreSQL
    /// (session: the safety bounds SET after connecting; transaction: every unit of work an
    /// explicit transaction with SET LOCAL bounds; default none).
    #[arg(long)]
    pub database_pooler: Option<String>,
    /// Fair share: hand accounts off once above the share by this fraction of it (default 0.1).
    #[arg(long)]
    pub rebalance_margin: Option<String>,
    /// Fair share: hand off at most this fraction of the share per cycle (default 0.1).
    #[arg(long)]
    pub rebalance_step: Option<String>,
    /// Fair share: how long an account handed off keeps copying here while the receiving node
    /// logs in ahead of the release (default 1s; 0s: no preparation).
    #[arg(long, value_name = "DURATION")]
    pub handoff_prepare: Option<String>,
    /// How often each follower reconciles with its masters regardless of events, repairing a lost
    /// last event (default 180s).
    #[arg(long, value_name = "DURATION")]
    pub reconcile_every: Option<String>,
    /// Secrets file holding the key that decrypts broker credentials (or set
    /// COPIER_CREDENTIALS_KEY; the key itself is never taken from the command line).
    #[arg(long, value_name = "PATH")]
    pub credentials_key_file: Option<String>,
    /// Apply pending migrations before starting instead of refusing to start.
    #[arg(long)]
    pub migrate: bool,
}

impl RunArgs {
    pub fn flags(&self) -> Vec<(&'static str, Option<String>)> {
        let mut flags = self.db.flags();
        flags.extend([
            ("platform", self.platform.clone()),
            ("node_id", self.node_id.clone()),
            ("capacity", self.capacity.clone()),
            ("lease", self.lease.clone()),
            ("fence", self.fence.clone()),
            ("cycle", self.cycle.clone()),
            ("http_listen", self.http_listen.clone()),
            ("log_format", self.log_format.clone()),
            ("listen_database_url", self.listen_database_url.clone()),
            ("events_poll", self.events_poll.clone()),
            ("database_pooler", self.database_pooler.clone()),
            ("rebalance_margin", self.rebalance_margin.clone()),
            ("rebalance_step", self.rebalance_step.clone()),
            ("handoff_prepare", self.handoff_prepare.clone()),
            ("reconcile_every", self.reconcile_every.clone()),
            ("credentials_key_file", self.credentials_key_file.clone()),
        ]);
        flags
    }
}
