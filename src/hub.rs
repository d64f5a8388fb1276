//! The node's one LISTEN connection (on `listen_database_url`: a pooler in transaction mode
//! breaks LISTEN), fanned out to whoever needs notifications:
//!
//! * release announcements (`copier_released`) from other nodes of the platform wake the lease
//!   loop to claim at once (instant handoff): a hand-off's release wakes its receiver alone, a
//!   release naming no one a few of the nodes below their shares, a departure every node
//!   ([`crate::channels::Release::wakes`]);
//! * master events (`copier_master_<id>`) go to every follower session subscribed to that master;
//!   a master session of this node hands its own events to its followers here as soon as they are
//!   stored ([`Hub::deliver`]), before their NOTIFY comes back, and each event reaches them once,
//!   by whichever way came first;
//! * account changes (`copier_links`, from triggers on `copy_links` and on the connection
//!   columns of `trading_accounts`) go to the session of the account whose links or row changed.
//!
//! [`Hub::subscribe`] returns only once the server has confirmed the LISTEN, so a follower that
//! subscribes and then reads its master's snapshot misses nothing in between. When the connection
//! drops, notifications may be lost: on reconnect every channel is listened to again, every
//! subscriber gets [`Signal::Gap`] (and reconciles), and the lease loop is woken.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use tokio::sync::{Notify, mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::channels::{self, Notice};
use crate::db;
use crate::model::events::MasterNotice;

/// How the hub wakes the lease loop, and what the lease loop tells it (and the hand-off
/// receiver) after each cycle and event: its room for accounts.
#[derive(Debug, Default)]
pub struct Wake {
    notify: Notify,
    /// The lease core's room, and while a cycle runs until when it holds
    /// ([`Wake::room_until`]).
    room: std::sync::Mutex<(channels::Room, Option<tokio::time::Instant>)>,
}

impl Wake {
    /// Wakes the lease loop to claim now (permits coalesce, as [`Notify::notify_one`]'s).
    pub fn now(&self) {
        self.notify.notify_one();
    }

    /// Resolves once woken.
    pub async fn notified(&self) {
        self.notify.notified().await;
    }

    /// The lease core's room ([`crate::lease::Core::room`]: below its share, not shutting
    /// down): which releases of the platform wake it, and whether it answers offers that it
    /// will claim.
    pub fn set_room(&self, room: channels::Room) {
        *self.room.lock().expect("never poisoned") = (room, None);
    }

    /// A cycle starts: the room holds until `until` (the cycle would be late then, and a late
    /// cycle's successor renews only: a node stalled in its statement answers no offer that
    /// it will claim), or until the loop sets it again.
    pub fn room_until(&self, until: tokio::time::Instant) {
        self.room.lock().expect("never poisoned").1 = Some(until);
    }

    pub fn room(&self) -> channels::Room {
        let (room, until) = *self.room.lock().expect("never poisoned");
        if until.is_none_or(|until| tokio::time::Instant::now() < until) {
            room
        } else {
            channels::Room::default()
        }
    }
}

/// What a subscriber receives.
#[derive(Debug, Clone, PartialEq)]
pub enum Signal {
    /// A master event, with the instant it arrived at the node (copy latency counts from it).
    /// Shared by every follower of the master (one decode, no copy per follower).
    Notice(std::sync::Arc<MasterNotice>, tokio::time::Instant),
    /// The account's row (server, login, role, credentials) or, for a follower, its copy links
    /// changed: re-read them.
    AccountChanged,
    /// The LISTEN connection was lost and restored: notifications may have been missed (once
    /// per subscriber channel).
    Gap,
    /// The database failed over and may have lost its last commits: masters' (epoch, seq) may
    /// have rewound, so forget them and reconcile (once per subscriber channel).
    FailedOver,
    /// Events without LISTEN: the master's published (epoch, seq) moved since the last poll;
    /// reconcile with its snapshot.
    MasterChanged(i64),
    /// A prepared hand-off's offer to this node, or the answer to this node's offer.
    Handoff(crate::channels::Handoff),
}

/// What a subscription is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Topic {
    /// A master's events (its own channel, listened to while someone on the node subscribes).
    Master(i64),
    /// An account's row or link changes (one channel for all, always listened to).
    Account(i64),
    /// Hand-off offers to this node (always listened to; never announced without LISTEN).
    HandoffOffers,
    /// The answer to this node's hand-off offer of an account (routed by account: a shutdown
    /// waits for thousands at once, and each waiter hears only its own).
    HandoffAnswer(i64),
}

enum Command {
    Subscribe {
        topic: Topic,
        id: u64,
        sender: mpsc::UnboundedSender<Signal>,
        ready: oneshot::Sender<()>,
    },
    Unsubscribe {
        topic: Topic,
        id: u64,
    },
    FailedOver,
    /// The lease loop reached the database again after failures: a LISTEN connection waiting out
    /// its backoff reconnects now.
    DatabaseBack,
    /// A master event this node stored ([`Hub::deliver`]).
    Deliver(Arc<MasterNotice>),
}

/// A handle to the node's LISTEN connection.
#[derive(Debug, Clone)]
pub struct Hub {
    commands: mpsc::UnboundedSender<Command>,
    next_id: Arc<AtomicU64>,
    wake: Arc<Wake>,
}

/// A live subscription; dropping it stops the LISTEN of a master's channel when nobody else on
/// the node needs that master.
#[derive(Debug)]
pub struct Subscription {
    hub: Hub,
    topic: Topic,
    id: u64,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let _ = self.hub.commands.send(Command::Unsubscribe {
            topic: self.topic,
            id: self.id,
        });
    }
}

impl Hub {
    /// Starts the hub: `wake` is woken on release announcements from other nodes of `platform`
    /// that it should claim ([`crate::channels::Release::wakes`]) and after every reconnect.
    pub fn spawn(
        options: PgConnectOptions,
        platform: String,
        node_id: String,
        wake: Arc<Wake>,
        cancel: CancellationToken,
    ) -> Hub {
        Self::spawn_measured(options, platform, node_id, wake, cancel, None)
    }

    /// As [`Hub::spawn`], reading PostgreSQL's NOTIFY queue usage into `notify_usage` every
    /// [`NOTIFY_USAGE_EVERY`] on the listening connection.
    pub fn spawn_measured(
        options: PgConnectOptions,
        platform: String,
        node_id: String,
        wake: Arc<Wake>,
        cancel: CancellationToken,
        notify_usage: Option<prometheus::Gauge>,
    ) -> Hub {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(tracing::Instrument::in_current_span(run(
            options,
            platform,
            node_id,
            wake.clone(),
            rx,
            cancel,
            notify_usage,
        )));
        Hub {
            commands: tx,
            next_id: Arc::new(AtomicU64::new(1)),
            wake,
        }
    }

    /// Whether the lease loop takes an account handed off to it ([`Wake::room`],
    /// [`channels::Room::takes`]): `leaving`, by a departing peer.
    pub fn takes(&self, leaving: bool) -> bool {
        self.wake.room().takes(leaving)
    }

    /// Subscribes `sender` to `topic`. Resolves once the LISTEN is confirmed (waiting while the
    /// database is unreachable); `None` if the hub has stopped.
    pub async fn subscribe(
        &self,
        topic: Topic,
        sender: mpsc::UnboundedSender<Signal>,
    ) -> Option<Subscription> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (ready, confirmed) = oneshot::channel();
        self.commands
            .send(Command::Subscribe {
                topic,
                id,
                sender,
                ready,
            })
            .ok()?;
        let subscription = Subscription {
            hub: self.clone(),
            topic,
            id,
        };
        confirmed.await.ok()?;
        Some(subscription)
    }

    /// Starts a hub that learns of master events by polling `master_state` every `every`
    /// instead of LISTEN (for transaction poolers and engines without LISTEN/NOTIFY): a master
    /// whose (epoch, seq) moved signals [`Signal::MasterChanged`] to its subscribers, and more
    /// free accounts of `platform` than at the last poll wake the lease loop. Account and link
    /// changes are not announced: every account subscriber is told to re-read its row and links
    /// once a minute.
    pub fn spawn_polling(
        options: PgConnectOptions,
        session: db::Session,
        platform: String,
        every: Duration,
        wake: Arc<Wake>,
        cancel: CancellationToken,
    ) -> Hub {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(tracing::Instrument::in_current_span(poll::run(
            options,
            session,
            platform,
            every,
            wake.clone(),
            rx,
            cancel,
        )));
        Hub {
            commands: tx,
            next_id: Arc::new(AtomicU64::new(1)),
            wake,
        }
    }

    /// Hands a master event this node's master session stored (the notice its NOTIFY carries,
    /// stamped as the database stamped it) to the master's subscribers on this node at once: a
    /// follower of a master on its own node does not wait for the notification's round trip
    /// through PostgreSQL. The NOTIFY of an event already delivered is not passed on again,
    /// nor an older one ([`Signal::Notice`] reaches each subscriber once per event).
    pub fn deliver(&self, notice: MasterNotice) {
        let _ = self.commands.send(Command::Deliver(Arc::new(notice)));
    }

    /// Tells every subscriber the database failed over ([`Signal::FailedOver`]); a LISTEN
    /// connection waiting out its backoff reconnects at once.
    pub fn failed_over(&self) {
        let _ = self.commands.send(Command::FailedOver);
    }

    /// The database answers again (the lease loop's cycle succeeded after failures): a LISTEN
    /// connection waiting out its backoff reconnects at once instead of up to its cap later.
    pub fn database_back(&self) {
        let _ = self.commands.send(Command::DatabaseBack);
    }
}

type Senders = HashMap<u64, mpsc::UnboundedSender<Signal>>;

#[derive(Default)]
struct Subscribers {
    by_master: HashMap<i64, Senders>,
    by_account: HashMap<i64, Senders>,
    /// [`Topic::HandoffOffers`] (under key 0).
    handoff_offers: HashMap<i64, Senders>,
    /// [`Topic::HandoffAnswer`], by account.
    handoff_answers: HashMap<i64, Senders>,
    /// Subscriptions waiting for their LISTEN to be confirmed.
    waiting: Vec<oneshot::Sender<()>>,
    /// The newest (epoch, seq) of each subscribed master passed on to its subscribers, by
    /// [`Hub::deliver`] or by NOTIFY: what is not newer, they have heard.
    heard: HashMap<i64, (i64, i64)>,
}

impl Subscribers {
    fn of(&mut self, topic: Topic) -> (&mut HashMap<i64, Senders>, i64) {
        match topic {
            Topic::Master(m) => (&mut self.by_master, m),
            Topic::Account(f) => (&mut self.by_account, f),
            Topic::HandoffOffers => (&mut self.handoff_offers, 0),
            Topic::HandoffAnswer(a) => (&mut self.handoff_answers, a),
        }
    }

    fn add(&mut self, topic: Topic, id: u64, sender: mpsc::UnboundedSender<Signal>) {
        let (map, key) = self.of(topic);
        map.entry(key).or_default().insert(id, sender);
    }

    /// Removes a subscriber; true when it was the last one of its topic.
    fn remove(&mut self, topic: Topic, id: u64) -> bool {
        let (map, key) = self.of(topic);
        let empty = map
            .get_mut(&key)
            .map(|s| {
                s.remove(&id);
                s.is_empty()
            })
            .unwrap_or(false);
        if empty {
            map.remove(&key);
            if let Topic::Master(m) = topic {
                self.heard.remove(&m);
            }
        }
        empty
    }

    /// Passes master `notice` to that master's subscribers, unless they heard it already (its
    /// other way here: [`Hub::deliver`] or NOTIFY) or a newer one. Each (epoch, seq) is stored
    /// and announced once; the sequence rewinds only with a database failover, after which
    /// [`Subscribers::failed_over`] forgets what was heard.
    fn master_notice(&mut self, notice: Arc<MasterNotice>) {
        let Some(senders) = self.by_master.get(&notice.master) else {
            return;
        };
        let at = (notice.epoch, notice.seq);
        if self
            .heard
            .get(&notice.master)
            .is_some_and(|heard| *heard >= at)
        {
            return;
        }
        self.heard.insert(notice.master, at);
        let received = tokio::time::Instant::now();
        for s in senders.values() {
            let _ = s.send(Signal::Notice(notice.clone(), received));
        }
    }

    /// The database failed over: masters' (epoch, seq) may have rewound with the lost tail.
    /// Every subscriber forgets what it applied ([`Signal::FailedOver`]), and so does the hub.
    fn failed_over(&mut self) {
        self.heard.clear();
        self.send_each(|| Signal::FailedOver);
    }

    /// One `signal` per subscriber channel (a follower subscribed to masters and to its links
    /// hears it once).
    fn send_each(&self, signal: fn() -> Signal) {
        let mut sent: Vec<&mpsc::UnboundedSender<Signal>> = Vec::new();
        for s in self
            .by_master
            .values()
            .chain(self.by_account.values())
            .flat_map(|m| m.values())
        {
            if !sent.iter().any(|o| o.same_channel(s)) {
                let _ = s.send(signal());
                sent.push(s);
            }
        }
    }
}

/// How often the listener reads the NOTIFY queue's usage (when asked to).
pub const NOTIFY_USAGE_EVERY: std::time::Duration = std::time::Duration::from_secs(15);

async fn run(
    options: PgConnectOptions,
    platform: String,
    node_id: String,
    wake: Arc<Wake>,
    mut commands: mpsc::UnboundedReceiver<Command>,
    cancel: CancellationToken,
    notify_usage: Option<prometheus::Gauge>,
) {
    let mut subs = Subscribers::default();
    let mut retry = crate::retry::LISTEN.start();
    let mut first = true;
    // The database was reported back while a connection attempt was under way: if that attempt
    // fails, the next one goes at once instead of after the backoff.
    let mut back_pending = false;
    while !cancel.is_cancelled() {
        // Connect and listen to everything wanted, taking commands meanwhile.
        let connecting = connect(&options, subs.by_master.keys().copied().collect());
        tokio::pin!(connecting);
        let connected = loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                r = &mut connecting => break r,
                cmd = commands.recv() => match cmd {
                    Some(cmd) => {
                        back_pending |= matches!(cmd, Command::DatabaseBack | Command::FailedOver);
                        apply_offline(&mut subs, cmd);
                    }
                    None => return,
                },
            }
        };
        let (mut listener, mut listening) = match connected {
            Ok(l) => l,
            Err(e) => {
                let delay = retry.failed();
                if std::mem::take(&mut back_pending) {
                    warn!(error = %db::describe(&e), "LISTEN connection failed before the database was reported back; trying again now");
                    continue;
                }
                warn!(error = %db::describe(&e), retry_in_ms = delay.as_millis() as u64, "LISTEN connection failed; handoffs wait for the next cycle and master events for the next reconcile");
                // Commands are taken while waiting (a failover is told to subscribers at once);
                // the database answering again ends the wait.
                let backoff = tokio::time::sleep(delay);
                tokio::pin!(backoff);
                loop {
                    tokio::select! {
                        _ = cancel.cancelled() => return,
                        _ = &mut backoff => break,
                        cmd = commands.recv() => match cmd {
                            Some(cmd) => {
                                let back = matches!(cmd, Command::DatabaseBack | Command::FailedOver);
                                apply_offline(&mut subs, cmd);
                                if back {
                                    info!("the database answers again: reconnecting LISTEN now");
                                    break;
                                }
                            }
                            None => return,
                        },
                    }
                }
                continue;
            }
        };
        retry.reset();
        back_pending = false;
        // Channels subscribed while connecting are listened to now.
        let missing: Vec<i64> = subs
            .by_master
            .keys()
            .copied()
            .filter(|m| !listening.contains(m))
            .collect();
        let mut failed = false;
        for m in missing {
            if listener.listen(&channels::master(m)).await.is_err() {
                failed = true;
                break;
            }
            listening.insert(m);
        }
        if failed {
            continue;
        }
        if first {
            info!("listening for release announcements and master events");
        } else {
            info!(
                masters = listening.len(),
                "LISTEN connection restored; subscribers reconcile"
            );
        }
        if !first {
            subs.send_each(|| Signal::Gap);
        }
        for ready in subs.waiting.drain(..) {
            let _ = ready.send(());
        }
        first = false;
        wake.now();

        // Traffic until the connection fails.
        let mut measure = tokio::time::interval(NOTIFY_USAGE_EVERY);
        measure.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = measure.tick(), if notify_usage.is_some() => {
                    // Bounded: a half-open connection must not hold up commands and shutdown.
                    let usage = tokio::time::timeout(
                        std::time::Duration::from_secs(5),
                        db::events::notify_queue_usage(&mut listener),
                    )
                    .await;
                    match usage {
                        Ok(Ok(u)) => {
                            if let Some(g) = &notify_usage {
                                g.set(u);
                            }
                        }
                        Ok(Err(e)) => {
                            warn!(error = %db::describe(&e), "reading the NOTIFY queue usage failed; reconnecting");
                            break;
                        }
                        Err(_) => {
                            warn!("reading the NOTIFY queue usage took over 5 s; reconnecting");
                            break;
                        }
                    }
                }
                cmd = commands.recv() => {
                    let Some(cmd) = cmd else { return };
                    match cmd {
                        Command::Subscribe { topic, id, sender, ready } => {
                            subs.add(topic, id, sender);
                            if let Topic::Master(master_id) = topic
                                && !listening.contains(&master_id)
                            {
                                if let Err(e) = listener.listen(&channels::master(master_id)).await {
                                    warn!(error = %db::describe(&e), master_id, "LISTEN failed; reconnecting");
                                    subs.waiting.push(ready);
                                    break;
                                }
                                listening.insert(master_id);
                            }
                            let _ = ready.send(());
                        }
                        Command::FailedOver => subs.failed_over(),
                        Command::DatabaseBack => {}
                        Command::Deliver(notice) => subs.master_notice(notice),
                        Command::Unsubscribe { topic, id } => {
                            if subs.remove(topic, id)
                                && let Topic::Master(master_id) = topic
                                && listening.remove(&master_id)
                                && listener.unlisten(&channels::master(master_id)).await.is_err()
                            {
                                break;
                            }
                        }
                    }
                }
                received = listener.try_recv() => match received {
                    Ok(Some(n)) => dispatch(&mut subs, &platform, &node_id, &wake, n.channel(), n.payload()),
                    Ok(None) => {
                        warn!("LISTEN connection lost; reconnecting");
                        break;
                    }
                    Err(e) => {
                        warn!(error = %db::describe(&e), "LISTEN connection failed; reconnecting");
                        break;
                    }
                }
            }
        }
    }
}

fn apply_offline(subs: &mut Subscribers, cmd: Command) {
    match cmd {
        Command::Subscribe {
            topic,
            id,
            sender,
            ready,
        } => {
            subs.add(topic, id, sender);
            subs.waiting.push(ready);
        }
        Command::Unsubscribe { topic, id } => {
            subs.remove(topic, id);
        }
        Command::FailedOver => subs.failed_over(),
        Command::DatabaseBack => {}
        // The followers of this node's masters hear their events while LISTEN is down too.
        Command::Deliver(notice) => subs.master_notice(notice),
    }
}

fn dispatch(
    subs: &mut Subscribers,
    platform: &str,
    node_id: &str,
    wake: &Wake,
    channel_name: &str,
    payload: &str,
) {
    match channels::decode(channel_name, payload) {
        Ok(Notice::Released {
            platform: from_platform,
            release,
        }) => {
            if release.wakes(
                &from_platform,
                platform,
                node_id,
                wake.room(),
                fastrand::f64(),
            ) {
                debug!(from_node = release.from.as_str(), to = ?release.to, accounts = release.accounts, "release announced");
                wake.now();
            }
        }
        Ok(Notice::AccountChanged(account)) => {
            for s in subs
                .by_account
                .get(&account)
                .into_iter()
                .flat_map(|m| m.values())
            {
                let _ = s.send(Signal::AccountChanged);
            }
        }
        Ok(Notice::Master(notice)) => subs.master_notice(Arc::new(notice)),
        Ok(Notice::Handoff(h)) => {
            let senders = if h.ready && h.from == node_id {
                subs.handoff_answers.get(&h.account_id)
            } else if !h.ready && h.to == node_id {
                subs.handoff_offers.get(&0)
            } else {
                None
            };
            for s in senders.into_iter().flat_map(|m| m.values()) {
                let _ = s.send(Signal::Handoff(h.clone()));
            }
        }
        Err(e) => {
            warn!(channel = channel_name, payload, error = %e, "unreadable notice ignored (a re-read or reconcile repairs what it carried)")
        }
    }
}

async fn connect(
    options: &PgConnectOptions,
    masters: Vec<i64>,
) -> Result<(PgListener, HashSet<i64>), sqlx::Error> {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(10))
        .connect_lazy_with(options.clone());
    let mut listener = PgListener::connect_with(&pool).await?;
    listener.listen(channels::RELEASED).await?;
    listener.listen(channels::ACCOUNTS).await?;
    listener.listen(channels::HANDOFF).await?;
    let mut listening = HashSet::new();
    for m in masters {
        listener.listen(&channels::master(m)).await?;
        listening.insert(m);
    }
    Ok((listener, listening))
}

/// Events without LISTEN: polling `master_state` and the free accounts.
mod poll {
    use std::collections::HashMap;
    use std::sync::Arc;
    use std::time::Duration;

    use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
    use tokio::sync::mpsc;
    use tokio_util::sync::CancellationToken;
    use tracing::{info, warn};

    use super::{Command, Signal, Subscribers, Topic, Wake};
    use crate::db;

    /// Each subscribed master's (epoch, seq) as last read.
    type Seen = HashMap<i64, Option<(i64, i64)>>;

    /// How often, without LISTEN, every session re-reads its row and links.
    pub(super) const ACCOUNTS_EVERY: Duration = Duration::from_secs(60);

    /// The longest a poll may take before it counts as failed (the hub takes commands again).
    const POLL_TIMEOUT: Duration = Duration::from_secs(5);

    #[allow(clippy::too_many_arguments)]
    pub(super) async fn run(
        options: PgConnectOptions,
        session: db::Session,
        platform: String,
        every: Duration,
        wake: Arc<Wake>,
        mut commands: mpsc::UnboundedReceiver<Command>,
        cancel: CancellationToken,
    ) {
        // Two connections at most: a poll and a subscription's first read may overlap.
        let pool = PgPoolOptions::new()
            .max_connections(2)
            .min_connections(0)
            .acquire_timeout(Duration::from_secs(10))
            .after_connect(move |conn, _meta| {
                Box::pin(async move { db::open_session(conn, &session).await })
            })
            .connect_lazy_with(options);
        let pool = db::Db::new(pool, session);
        let mut accounts = tokio::time::interval(ACCOUNTS_EVERY);
        accounts.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        accounts.reset();
        let mut subs = Subscribers::default();
        let mut seen = Seen::new();
        let mut free: Option<i64> = None;
        let mut failing = false;
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        info!(
            every_ms = every.as_millis() as u64,
            "polling for master events and free accounts (no LISTEN)"
        );
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                cmd = commands.recv() => {
                    let Some(cmd) = cmd else { return };
                    match cmd {
                        Command::Subscribe { topic, id, sender, ready } => {
                            subs.add(topic, id, sender);
                            if let Topic::Master(m) = topic
                                && !seen.contains_key(&m)
                            {
                                // What the subscriber's snapshot read follows: every change after
                                // this read is signalled, so nothing between is missed.
                                match tokio::time::timeout(POLL_TIMEOUT, pool.run(async |c| db::events::published_seqs(c, &[m]).await)).await {
                                    Ok(Ok(now)) => {
                                        seen.insert(m, now.get(&m).copied());
                                    }
                                    failed => {
                                        let error = match failed {
                                            Ok(Err(e)) => db::describe(&e),
                                            _ => "no answer within 5 s".to_string(),
                                        };
                                        warn!(error, master_id = m, "reading a master's sequence failed; the subscription waits for the next poll");
                                        subs.waiting.push(ready);
                                        continue;
                                    }
                                }
                            }
                            let _ = ready.send(());
                        }
                        Command::Unsubscribe { topic, id } => {
                            if subs.remove(topic, id)
                                && let Topic::Master(m) = topic
                            {
                                seen.remove(&m);
                            }
                        }
                        Command::FailedOver => subs.failed_over(),
                        // Polling retries every poll anyway.
                        Command::DatabaseBack => {}
                        // Its subscribers hear it now; the poll that finds it signals nothing more.
                        Command::Deliver(notice) => {
                            let at = (notice.epoch, notice.seq);
                            if let Some(seen) = seen.get_mut(&notice.master)
                                && seen.is_none_or(|seen| seen < at)
                            {
                                *seen = Some(at);
                            }
                            subs.master_notice(notice);
                        }
                    }
                }
                _ = accounts.tick() => {
                    for s in subs.by_account.values().flat_map(|s| s.values()) {
                        let _ = s.send(Signal::AccountChanged);
                    }
                }
                _ = tick.tick() => {
                    let masters: Vec<i64> = subs.by_master.keys().copied().collect();
                    let polled = tokio::time::timeout(POLL_TIMEOUT, pool.run(async |c| {
                        let now = db::events::published_seqs(&mut *c, &masters).await?;
                        let count = db::events::free_accounts(&mut *c, &platform).await?;
                        Ok::<_, sqlx::Error>((now, count))
                    }))
                    .await;
                    let (now, count) = match polled {
                        Ok(Ok(p)) => p,
                        failed => {
                            if !failing {
                                let error = match failed {
                                    Ok(Err(e)) => db::describe(&e),
                                    _ => "no answer within 5 s".to_string(),
                                };
                                warn!(error, "polling for master events failed; retrying every poll (followers also reconcile on their own schedule)");
                            }
                            failing = true;
                            continue;
                        }
                    };
                    if failing {
                        info!("polling for master events works again; every follower reconciles");
                        subs.send_each(|| Signal::Gap);
                        failing = false;
                    }
                    for ready in subs.waiting.drain(..) {
                        let _ = ready.send(());
                    }
                    for m in masters {
                        let current = now.get(&m).copied();
                        let before = seen.insert(m, current);
                        if before.is_some_and(|b| b != current) {
                            for s in subs.by_master.get(&m).into_iter().flat_map(|s| s.values()) {
                                let _ = s.send(Signal::MasterChanged(m));
                            }
                        }
                    }
                    if free.is_some_and(|f| count > f) {
                        wake.now();
                    }
                    free = Some(count);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// While a cycle runs, the room it had holds only until that cycle would be late (a late
    /// cycle's successor claims nothing, so a node stalled in its statement must not answer
    /// offers that it will claim); the loop's next turn sets it afresh.
    #[test]
    fn while_a_cycle_runs_the_room_holds_only_until_it_would_be_late() {
        let wake = Wake::default();
        let room = channels::Room {
            lacks: 3,
            peers_below: 7,
            takes_over: true,
        };
        wake.set_room(room);
        assert_eq!(wake.room(), room);
        let now = tokio::time::Instant::now();
        wake.room_until(now + std::time::Duration::from_secs(60));
        assert_eq!(wake.room(), room, "a cycle on time so far");
        wake.room_until(now);
        assert!(!wake.room().any(), "a cycle running late");
        assert!(
            !wake.room().takes(true),
            "a cycle running late takes no departing peer's accounts either"
        );
        wake.set_room(room);
        assert_eq!(wake.room(), room, "set again after the cycle");
        wake.set_room(channels::Room::default());
        wake.room_until(now + std::time::Duration::from_secs(60));
        assert!(!wake.room().any(), "no room stays none");
    }
}
