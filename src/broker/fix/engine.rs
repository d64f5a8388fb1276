//! One FIX session on QuickFIX (the `quickfix` crate, a binding to the C++ engine): logon,
//! heartbeats, TestRequest, sequence numbers, ResendRequest and gap fill are the engine's.
//!
//! Each account runs its own initiator on a thread of its own (QuickFIX's objects are neither
//! `Send` nor `'static`): the thread builds the settings, the callbacks and the initiator, starts
//! it, and waits for [`Engine`] to be dropped, then logs out and stops. After a venue's Logout
//! (or the session's own to a Logon answer numbered too low: a venue that started its numbers
//! again without one), QuickFIX's single-threaded initiator opens no new connection: a session
//! still down a few seconds later has its initiator built again (an empty store, its first Logon
//! resetting both sides' numbers). (QuickFIX's threaded initiator does reconnect, but a review of its C++ found
//! a socket closed twice when it stops during a connect.) What the engine receives
//! reaches the async side as [`EngineEvent`]s; messages go out with [`Engine::send`], which
//! QuickFIX makes safe from any thread.
//!
//! Sequence numbers: an engine starts with an empty in-memory store and its first Logon carries
//! ResetSeqNumFlag (141=Y), so a new owner never needs the previous owner's store; reconnects of
//! the same engine keep the store, so the venue's ResendRequest and gap fill recover what a drop
//! lost. An order is never sent late: a NewOrderSingle the engine would resend (PossDupFlag) is
//! turned into a gap fill, and its outcome is found by OrderStatusRequest instead.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use quickfix::dictionary_item::{
    AllowUnknownMsgFields, ConnectionType, DataDictionary, HeartBtInt, LogonTimeout,
    ReconnectInterval, SocketConnectHost, SocketConnectPort, SocketNodelay, UseDataDictionary,
    ValidateFieldsHaveValues, ValidateFieldsOutOfOrder, ValidateUserDefinedFields,
};
use quickfix::{
    Application, ApplicationCallback, ConnectionHandler, Dictionary, FieldMap, FixSocketServerKind,
    Initiator, LogCallback, LogFactory, MemoryMessageStoreFactory, Message, MsgFromAdminError,
    MsgFromAppError, MsgToAppError, SessionContainer, SessionId, SessionSettings,
};
use tokio::sync::mpsc;
use tracing::{debug, warn};

use super::msg::Fields;
use crate::secret::Secret;

/// Where a session connects and who it is.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub host: String,
    pub port: u16,
    pub sender_comp_id: String,
    pub target_comp_id: String,
    /// The account's own SenderSubID; the node id then goes in SenderLocationID (142).
    pub sender_sub_id: Option<String>,
    pub node_id: String,
    pub username: String,
    pub password: Option<Secret>,
    pub heartbeat_secs: u16,
    pub reconnect_secs: u16,
}

/// What the engine saw.
#[derive(Debug)]
pub enum EngineEvent {
    LoggedOn,
    LoggedOut,
    /// A Logout from the venue, with its Text (why a Logon was refused).
    LogoutText(String),
    /// An application message (ExecutionReport, PositionReport, ...).
    App(Fields),
    /// The engine could not be created or started.
    Failed(String),
}

/// A running session. [`Engine::stop`] logs out and waits until the engine is gone; dropping it
/// logs out and stops the engine without waiting.
#[derive(Debug)]
pub struct Engine {
    config: EngineConfig,
    logged_on: Arc<AtomicBool>,
    /// True until the engine thread starts stopping; sends hold it, so no message is handed to
    /// a session QuickFIX is tearing down.
    alive: Arc<std::sync::Mutex<bool>>,
    /// Dropped to tell the engine thread to log out and stop.
    stop: std::sync::Mutex<Option<std::sync::mpsc::Sender<()>>>,
    /// True once the engine thread is done (logged out, stopped, its identity free again).
    done: tokio::sync::watch::Receiver<bool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// How long a stopping engine waits for the venue's answer to its Logout before it disconnects
/// anyway: a venue that answers at all answers within a round trip, and one that does not must
/// not hold a release (and so the account's next owner) for long.
pub const LOGOUT: Duration = Duration::from_secs(3);
/// How often the engine thread looks whether a Logout left the session down.
const REBUILD_CHECK: Duration = Duration::from_millis(200);
/// How long after a Logout a session not logged on again has its initiator built
/// again: past QuickFIX's reconnect interval (1 s) and its connect.
const REBUILD_AFTER: Duration = Duration::from_secs(3);

/// Engines of this process by session identity: QuickFIX keeps one global registry of sessions,
/// so a second engine for the same identity waits for the first to be gone.
static LIVE: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

impl Engine {
    /// Starts the session's engine (it connects and logs on in the background). `None` while an
    /// engine of this process still holds the identity (try again shortly).
    pub fn start(
        config: EngineConfig,
        events: mpsc::UnboundedSender<EngineEvent>,
    ) -> Option<Engine> {
        let key = config.identity();
        {
            let mut live = LIVE.lock().expect("fix engines");
            if live.contains(&key) {
                return None;
            }
            live.push(key.clone());
        }
        let logged_on = Arc::new(AtomicBool::new(false));
        let alive = Arc::new(std::sync::Mutex::new(true));
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let (done_tx, done) = tokio::sync::watch::channel(false);
        let thread_config = config.clone();
        let flag = logged_on.clone();
        let thread_alive = alive.clone();
        let thread = std::thread::Builder::new()
            .name(format!("fix-{}", config.sender_comp_id))
            .spawn(move || {
                // Frees the identity however the thread ends (a panic included), then says so.
                struct Release(String, tokio::sync::watch::Sender<bool>);
                impl Drop for Release {
                    fn drop(&mut self) {
                        if let Ok(mut live) = LIVE.lock() {
                            live.retain(|k| *k != self.0);
                        }
                        let _ = self.1.send(true);
                    }
                }
                let _release = Release(key, done_tx);
                if let Err(e) = run(&thread_config, flag, &thread_alive, events.clone(), stopped) {
                    let _ = events.send(EngineEvent::Failed(e));
                }
            })
            .expect("spawning a FIX engine thread");
        Some(Engine {
            config,
            logged_on,
            alive,
            stop: std::sync::Mutex::new(Some(stop)),
            done,
            thread: Some(thread),
        })
    }

    /// Logs out (a Logout sent and the venue's Logout awaited, at most [`LOGOUT`]) and stops the
    /// engine; returns once its thread is done, so the venue has seen the session end before the
    /// caller goes on (a release must not let the next owner's Logon meet a session still open).
    pub async fn stop(&self) {
        drop(self.stop.lock().expect("fix engine").take());
        let mut done = self.done.clone();
        // Past the Logout's bound, QuickFIX disconnects at once; the margin covers that.
        let bound = LOGOUT + Duration::from_secs(2);
        if tokio::time::timeout(bound, done.wait_for(|d| *d))
            .await
            .is_err()
        {
            warn!(session = %self.config.identity(), "a FIX session did not stop within {bound:?} of its Logout; going on without it");
        }
    }

    pub fn logged_on(&self) -> bool {
        self.logged_on.load(Ordering::Acquire)
    }

    /// Hands an application message to the engine. `false` (nothing sent) while not logged on.
    /// QuickFIX fills the header (BeginString, CompIDs, MsgSeqNum, SendingTime) and the
    /// callbacks add the node id.
    pub fn send(&self, msg_type: &str, body: &[(u32, String)]) -> Result<bool, String> {
        let alive = self.alive.lock().expect("fix engine");
        if !*alive || !self.logged_on() {
            return Ok(false);
        }
        let session = session_id(&self.config).map_err(|e| e.to_string())?;
        let mut msg = Message::new();
        msg.with_header_mut(|h| h.set_field(35, msg_type))
            .map_err(|e| e.to_string())?;
        for (tag, value) in body {
            msg.set_field(*tag as i32, value.as_str())
                .map_err(|e| e.to_string())?;
        }
        quickfix::send_to_target(msg, &session).map_err(|e| e.to_string())?;
        Ok(true)
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        drop(self.stop.get_mut().ok().and_then(Option::take));
        // The thread logs out and stops on its own; nobody waits for it here (a drop may run on
        // the async runtime). The registry frees the identity when it is done.
        drop(self.thread.take());
    }
}

impl EngineConfig {
    /// The session identity QuickFIX registers (one engine per identity and process).
    pub fn identity(&self) -> String {
        format!("FIX.4.4:{}->{}", self.sender_comp_id, self.target_comp_id)
    }
}

fn session_id(config: &EngineConfig) -> Result<SessionId, quickfix::QuickFixError> {
    SessionId::try_new(
        "FIX.4.4",
        &config.sender_comp_id,
        &config.target_comp_id,
        "",
    )
}

/// The engine thread: builds everything QuickFIX needs on its stack, runs until told to stop.
fn run(
    config: &EngineConfig,
    logged_on: Arc<AtomicBool>,
    alive: &std::sync::Mutex<bool>,
    events: mpsc::UnboundedSender<EngineEvent>,
    stopped: std::sync::mpsc::Receiver<()>,
) -> Result<(), String> {
    let e = |e: quickfix::QuickFixError| e.to_string();
    let mut settings = SessionSettings::new();
    settings
        .set(
            None,
            Dictionary::try_from_items(&[
                &ConnectionType::Initiator,
                &ReconnectInterval(config.reconnect_secs.max(1)),
                &HeartBtInt(config.heartbeat_secs.max(1)),
                &LogonTimeout(10),
                &SocketNodelay(true),
                &UseDataDictionary(true),
                &DataDictionary(&dictionary_path()?),
                &AllowUnknownMsgFields(true),
                &ValidateUserDefinedFields(false),
                &ValidateFieldsOutOfOrder(false),
                &ValidateFieldsHaveValues(false),
                &("StartTime", "00:00:00"),
                &("EndTime", "00:00:00"),
                &("BeginString", "FIX.4.4"),
                &("PersistMessages", "Y"),
            ])
            .map_err(e)?,
        )
        .map_err(e)?;
    let session = session_id(config).map_err(e)?;
    settings
        .set(
            Some(&session),
            Dictionary::try_from_items(&[
                &SocketConnectHost(&config.host),
                &SocketConnectPort(config.port),
            ])
            .map_err(e)?,
        )
        .map_err(e)?;
    // A Logout (the venue's, or the session's own to a Logon answer numbered too low) leaves
    // QuickFIX's single-threaded initiator without a new connection (it times its Logon out,
    // every 10 s, for ever): past a reconnect's interval without a logon,
    // the initiator is built again, its store empty (its first Logon resets both sides' numbers,
    // as a new owner's does).
    while initiate(config, &settings, &logged_on, alive, &events, &stopped)? {
        warn!(session = %config.identity(), "the FIX session did not log on again after a Logout: its initiator started again (its first Logon resets the sequence numbers)");
    }
    Ok(())
}

/// One initiator of the engine thread, until the engine is stopped (false) or a Logout
/// left the session down (true: stopped, to be built again).
fn initiate(
    config: &EngineConfig,
    settings: &SessionSettings,
    logged_on: &Arc<AtomicBool>,
    alive: &std::sync::Mutex<bool>,
    events: &mpsc::UnboundedSender<EngineEvent>,
    stopped: &std::sync::mpsc::Receiver<()>,
) -> Result<bool, String> {
    let e = |e: quickfix::QuickFixError| e.to_string();
    let session = session_id(config).map_err(e)?;
    let callbacks = Callbacks {
        config: config.clone(),
        logged_on: logged_on.clone(),
        events: events.clone(),
        reset: AtomicBool::new(true),
        cut: std::sync::Mutex::new(None),
    };
    let app = Application::try_new(&callbacks).map_err(e)?;
    let store = MemoryMessageStoreFactory::new();
    let logs = LogFactory::try_new(&EngineLog).map_err(e)?;
    let mut initiator = Initiator::try_new(
        settings,
        &app,
        &store,
        &logs,
        FixSocketServerKind::SingleThreaded,
    )
    .map_err(e)?;
    initiator.start().map_err(e)?;
    // Until the Engine is stopped or dropped (its sender with it), or a Logout left the
    // session down.
    let rebuild = loop {
        match stopped.recv_timeout(REBUILD_CHECK) {
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                if callbacks.down_since_cut(REBUILD_AFTER) {
                    break true;
                }
            }
            _ => break false,
        }
    };
    if rebuild {
        // No message goes to an initiator being stopped.
        *alive.lock().expect("fix engine") = false;
        if let Err(err) = initiator.stop() {
            warn!(session = %config.identity(), error = %err, "stopping a FIX initiator failed");
        }
        callbacks.logged_on.store(false, Ordering::Release);
        *alive.lock().expect("fix engine") = true;
        return Ok(true);
    }
    *alive.lock().expect("fix engine") = false;
    // The Logout, and the venue's answer to it, before the engine stops: QuickFIX's own stop
    // would log out too, but checks for the answer only once a second.
    if callbacks.logged_on.load(Ordering::Acquire) {
        match initiator.session(session.clone()) {
            Ok(mut s) => {
                if let Err(err) = s.logout() {
                    warn!(session = %config.identity(), error = %err, "a FIX Logout could not be sent");
                }
            }
            Err(err) => {
                warn!(session = %config.identity(), error = %err, "a FIX Logout could not be sent")
            }
        }
        // QuickFIX sends the Logout at its next turn: on its one-second timer, or at once when
        // a message arrives. A TestRequest makes the venue answer (a Heartbeat) at once.
        let mut probe = Message::new();
        let sent = probe
            .with_header_mut(|h| h.set_field(35, "1"))
            .and_then(|()| probe.set_field(112, "logout"))
            .and_then(|()| quickfix::send_to_target(probe, &session));
        if let Err(err) = sent {
            debug!(session = %config.identity(), error = %err, "a TestRequest ahead of the Logout could not be sent");
        }
        let polls = (LOGOUT.as_millis() / POLL.as_millis()) as usize;
        for _ in 0..polls {
            if !callbacks.logged_on.load(Ordering::Acquire) {
                break;
            }
            std::thread::sleep(POLL);
        }
    }
    if let Err(err) = initiator.stop() {
        warn!(session = %config.identity(), error = %err, "stopping a FIX session failed");
    }
    callbacks.logged_on.store(false, Ordering::Release);
    Ok(false)
}

struct Callbacks {
    config: EngineConfig,
    logged_on: Arc<AtomicBool>,
    events: mpsc::UnboundedSender<EngineEvent>,
    /// True until a Logon of this engine is accepted: until then every Logon carries
    /// ResetSeqNumFlag (a refused first attempt must not leave the next without it).
    reset: AtomicBool,
    /// When a Logout last cut the session short: the venue's, or the session's own to a Logon
    /// answer numbered below what it expects (cleared at the next logon).
    cut: std::sync::Mutex<Option<tokio::time::Instant>>,
}

impl Callbacks {
    /// A Logout cut the session short at least `after` ago and it has not logged on since.
    fn down_since_cut(&self, after: Duration) -> bool {
        !self.logged_on.load(Ordering::Acquire)
            && self
                .cut
                .lock()
                .expect("fix callbacks")
                .is_some_and(|at| at.elapsed() >= after)
    }

    /// The session was cut short now, unless it was already (and not logged on since): the
    /// first cut counts, so Logouts that follow do not put the rebuild off.
    fn cut_now(&self) {
        self.cut
            .lock()
            .expect("fix callbacks")
            .get_or_insert_with(tokio::time::Instant::now);
    }

    fn stamp_node(&self, msg: &mut Message) {
        let tag = if self.config.sender_sub_id.is_some() {
            142
        } else {
            50
        };
        let _ = msg.with_header_mut(|h| {
            if let Some(sub) = &self.config.sender_sub_id {
                let _ = h.set_field(50, sub.as_str());
            }
            h.set_field(tag, self.config.node_id.as_str())
        });
    }
}

fn msg_type(msg: &Message) -> String {
    msg.with_header(|h| h.get_field(35)).unwrap_or_default()
}

impl ApplicationCallback for Callbacks {
    fn on_logon(&self, _session: &SessionId) {
        self.reset.store(false, Ordering::Release);
        *self.cut.lock().expect("fix callbacks") = None;
        self.logged_on.store(true, Ordering::Release);
        let _ = self.events.send(EngineEvent::LoggedOn);
    }

    fn on_logout(&self, _session: &SessionId) {
        self.logged_on.store(false, Ordering::Release);
        let _ = self.events.send(EngineEvent::LoggedOut);
    }

    fn on_msg_to_admin(&self, msg: &mut Message, _session: &SessionId) {
        self.stamp_node(msg);
        let kind = msg_type(msg);
        if kind == "5"
            && !self.logged_on.load(Ordering::Acquire)
            && msg
                .get_field(58)
                .is_some_and(|text| text.starts_with("MsgSeqNum too low"))
        {
            // The venue's answer to the Logon is numbered below what the session expects: the
            // venue started its numbers again without a Logout (a restart that lost its store).
            // QuickFIX logs out, and its initiator is built again (its first Logon resets both
            // sides' numbers): a Logon with the session's numbers would be answered so for ever.
            warn!(session = %self.config.identity(), "the venue's Logon answer is numbered below the session's (the venue started its numbers again): logged out");
            self.cut_now();
        }
        if kind == "A" {
            let _ = msg.set_field(553, self.config.username.as_str());
            if let Some(password) = &self.config.password {
                let _ = msg.set_field(554, password.expose());
            }
            if self.reset.load(Ordering::Acquire) {
                // QuickFIX resets its own store when it sees the flag on an outgoing Logon.
                let _ = msg.set_field(141, "Y");
            }
        }
    }

    fn on_msg_to_app(&self, msg: &mut Message, _session: &SessionId) -> Result<(), MsgToAppError> {
        let poss_dup = msg.with_header(|h| h.get_field(43)).as_deref() == Some("Y");
        if poss_dup && msg_type(msg) == "D" {
            // A resend of an order: never executed late. The engine sends a gap fill instead.
            debug!(session = %self.config.identity(), "an order resend became a gap fill");
            return Err(MsgToAppError::DoNotSend);
        }
        self.stamp_node(msg);
        Ok(())
    }

    fn on_msg_from_admin(
        &self,
        msg: &Message,
        _session: &SessionId,
    ) -> Result<(), MsgFromAdminError> {
        if msg_type(msg) == "5" {
            if self.logged_on.load(Ordering::Acquire) {
                self.cut_now();
            }
            let text = msg.get_field(58).unwrap_or_default();
            let _ = self.events.send(EngineEvent::LogoutText(text));
        }
        Ok(())
    }

    fn on_msg_from_app(&self, msg: &Message, _session: &SessionId) -> Result<(), MsgFromAppError> {
        match msg.to_fix_string() {
            Ok(text) => {
                let _ = self.events.send(EngineEvent::App(Fields::parse(&text)));
            }
            Err(err) => warn!(error = %err, "a FIX message could not be read"),
        }
        Ok(())
    }
}

/// QuickFIX's session events go to the log; the messages themselves never do (a Logon carries
/// the password).
struct EngineLog;

impl LogCallback for EngineLog {
    fn on_event(&self, session: Option<&SessionId>, text: &str) {
        let session = session.map(|s| s.to_repr()).unwrap_or_default();
        debug!(session, event = text, "fix engine");
    }
}

/// The data dictionary (`dictionary.xml`, built in), written to a file because QuickFIX reads it
/// from a path: one file per dictionary version, shared by every process of the machine (a file
/// per process left one behind at every restart).
fn dictionary_path() -> Result<String, String> {
    static PATH: std::sync::OnceLock<Result<String, String>> = std::sync::OnceLock::new();
    PATH.get_or_init(|| {
        write_dictionary(&std::env::temp_dir(), include_str!("dictionary.xml"))
            .map(|path| path.display().to_string())
    })
    .clone()
}

/// Writes `xml` to `dir` under a name made from its content, unless a file of that name already
/// holds it: written to a file of this process first and renamed into place, so a process never
/// reads another's half-written file, and a file of that name with other content is replaced.
fn write_dictionary(dir: &std::path::Path, xml: &str) -> Result<std::path::PathBuf, String> {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::hash::DefaultHasher::new();
    xml.hash(&mut hasher);
    let name = format!("copier-node-fix44-{:016x}.xml", hasher.finish());
    let path = dir.join(&name);
    if std::fs::read(&path).is_ok_and(|held| held == xml.as_bytes()) {
        return Ok(path);
    }
    let partial = dir.join(format!("{name}.{}.partial", std::process::id()));
    std::fs::write(&partial, xml)
        .and_then(|()| std::fs::rename(&partial, &path))
        .map_err(|e| {
            let _ = std::fs::remove_file(&partial);
            format!("writing the FIX dictionary to {}: {e}", path.display())
        })?;
    Ok(path)
}

/// How long [`Engine`] users wait between checks of a condition.
pub const POLL: Duration = Duration::from_millis(20);

#[cfg(test)]
mod tests {
    use super::write_dictionary;

    fn files(dir: &std::path::Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    /// Every process of a build writes the dictionary to the same one file (none left behind
    /// per process), a damaged copy is replaced, and another version gets a file of its own.
    #[test]
    fn the_fix_dictionary_is_one_file_per_version_not_one_per_process() {
        let dir = std::env::temp_dir().join(format!("copier-dict-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let first = write_dictionary(&dir, "<fix v1/>").unwrap();
        let again = write_dictionary(&dir, "<fix v1/>").unwrap();
        assert_eq!(first, again);
        let name = first.file_name().unwrap().to_string_lossy().into_owned();
        assert!(!name.contains(&std::process::id().to_string()), "{name}");
        assert_eq!(files(&dir).len(), 1, "{:?}", files(&dir));
        std::fs::write(&first, "<fix v1").unwrap();
        assert_eq!(write_dictionary(&dir, "<fix v1/>").unwrap(), first);
        assert_eq!(std::fs::read_to_string(&first).unwrap(), "<fix v1/>");
        let other = write_dictionary(&dir, "<fix v2/>").unwrap();
        assert_ne!(other, first);
        assert_eq!(std::fs::read_to_string(&other).unwrap(), "<fix v2/>");
        assert_eq!(files(&dir).len(), 2, "{:?}", files(&dir));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
