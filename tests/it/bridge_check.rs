//! The conformance kit (`copier-node bridge-check`, issue 44) against the simulated broker in
//! each of its modes, where every check passes, and against deliberately wrong bridges: a proxy
//! in front of the simulated broker that gets one thing wrong, each shown to fail its check.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use copier_node::bridge_check::{self, CHECKS, Options, Outcome, Report};
use copier_node::sim_broker::server::{ServeOptions, SimBroker};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use crate::support::broker::Scratch;
use crate::support::process::binary;

/// The kit's longest wait: the simulated broker answers at once, so only a double that never
/// sends what a check waits for (events) uses it up.
const TIMEOUT: Duration = Duration::from_secs(2);

async fn broker(dir: &Scratch, tune: impl FnOnce(&mut ServeOptions)) -> SimBroker {
    let mut options = ServeOptions::new("127.0.0.1:0", dir.path("journal.jsonl"));
    tune(&mut options);
    SimBroker::start(options).await.unwrap()
}

async fn check(server: String) -> Report {
    bridge_check::run(&Options {
        server,
        login: "4001".to_string(),
        password: None,
        symbol: Some("EURUSD".to_string()),
        timeout: TIMEOUT,
    })
    .await
}

#[tokio::test]
async fn the_simulated_broker_passes_every_check_in_each_of_its_modes() {
    type Tune = fn(&mut ServeOptions);
    let modes: [(&str, Tune); 6] = [
        ("default", |_| {}),
        ("--mt4", |o| o.mt4 = true),
        ("--no-fence-check --no-dedupe", |o| {
            o.fence_check = false;
            o.dedupe = false;
        }),
        ("--reply-first", |o| o.reply_first = true),
        ("--no-fence-request", |o| o.fence_request = false),
        ("--mt4 --no-fence-check --no-dedupe", |o| {
            o.mt4 = true;
            o.fence_check = false;
            o.dedupe = false;
        }),
    ];
    for (mode, tune) in modes {
        let dir = Scratch::new("bridge-check-modes");
        let sim = broker(&dir, tune).await;
        let report = check(sim.addr.to_string()).await;
        assert_eq!(
            report.checks.iter().map(|c| c.check).collect::<Vec<_>>(),
            CHECKS.to_vec(),
            "{mode}: every check reported, in order"
        );
        for c in &report.checks {
            assert_eq!(c.result, Outcome::Passed, "{mode}: {}", report.text());
        }
        assert!(report.passed, "{mode}");
        if mode.starts_with("--mt4") {
            let partial = report.check("partial_close").unwrap();
            assert!(partial.detail.contains("renumbered"), "{}", partial.detail);
        }
        // The kit leaves the account as it found it: nothing of its own open or resting.
        let (positions, orders) = open_and_resting(sim.addr).await;
        assert_eq!((positions, orders), (0, 0), "{mode}");
        sim.stop().await;
    }
}

/// Positions and resting orders of login 4001, read on a connection of the test's own.
async fn open_and_resting(addr: SocketAddr) -> (usize, usize) {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (read, mut write) = stream.into_split();
    let mut lines = BufReader::new(read).lines();
    let mut ask = async |id: u64, op: &str| -> Value {
        let line = json!({"id": id, "op": op, "login": "4001", "client": "test", "protocol": 1});
        write
            .write_all(format!("{line}\n").as_bytes())
            .await
            .unwrap();
        loop {
            let frame: Value =
                serde_json::from_str(&lines.next_line().await.unwrap().unwrap()).unwrap();
            if frame["id"] == id {
                return frame["result"].clone();
            }
        }
    };
    ask(1, "hello").await;
    let positions = ask(2, "positions").await["positions"]
        .as_array()
        .unwrap()
        .len();
    let orders = ask(3, "orders").await["orders"].as_array().unwrap().len();
    (positions, orders)
}

/// What a wrong double gets wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wrong {
    /// `hello` answers protocol 2.
    Protocol,
    /// Every symbol's volume step is 0.
    ZeroStep,
    /// Positions lose their comment.
    StripComment,
    /// A partially closed position loses its comment.
    PartialLosesMarker,
    /// A stop change is passed on without its stops.
    IgnoreStops,
    /// The history is empty.
    NoHistory,
    /// No event reaches the client.
    NoEvents,
    /// Refusals carry no code.
    NoCodes,
    /// The orders of a dropped connection are sent again (with new client order ids).
    ReplayOnDrop,
    /// An amend is answered done and never passed on.
    AmendIgnored,
    /// The login's reply carries no `fence`.
    NoFence,
    /// The account's currency is not an ISO 4217 code.
    BadCurrency,
    /// The first close of a whole position is answered done and never passed on.
    CloseIgnored,
    /// The logout is refused.
    LogoutRefused,
    /// `orders` is answered as by a bridge older than pending orders (not a fault).
    OrdersInvalid,
    /// An `opened` event is held back until the account's next event has gone out.
    EventsOutOfOrder,
}

impl Wrong {
    /// The check this wrong shows in.
    fn check(self) -> &'static str {
        match self {
            Wrong::Protocol => "hello",
            Wrong::ZeroStep => "symbols",
            Wrong::StripComment => "open",
            Wrong::PartialLosesMarker => "partial_close",
            Wrong::IgnoreStops => "stops",
            Wrong::NoHistory => "history",
            Wrong::NoEvents => "events",
            Wrong::NoCodes => "refusals",
            Wrong::ReplayOnDrop => "unknown_outcome",
            Wrong::AmendIgnored => "pending",
            Wrong::NoFence => "login",
            Wrong::BadCurrency => "account",
            Wrong::CloseIgnored => "close",
            Wrong::LogoutRefused => "logout",
            Wrong::OrdersInvalid => "pending",
            Wrong::EventsOutOfOrder => "events",
        }
    }
}

/// A wrong bridge: a proxy in front of `upstream` that gets `wrong` wrong; returns its address.
async fn double(upstream: SocketAddr, wrong: Wrong) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            tokio::spawn(relay(client, upstream, wrong));
        }
    });
    addr
}

#[derive(Default)]
struct Seen {
    /// Requests by id (their op and body), for the replies.
    requests: HashMap<u64, Value>,
    /// Tickets whose partial close was answered.
    partial: HashSet<i64>,
    /// A whole position's close was answered without being passed on.
    close_ignored: bool,
}

async fn relay(client: TcpStream, upstream: SocketAddr, wrong: Wrong) {
    let Ok(server) = TcpStream::connect(upstream).await else {
        return;
    };
    let (client_read, mut client_write) = client.into_split();
    let (server_read, mut server_write) = server.into_split();
    let seen = Arc::new(Mutex::new(Seen::default()));
    let (to_client, mut outbox) = mpsc::unbounded_channel::<Value>();
    tokio::spawn(async move {
        while let Some(frame) = outbox.recv().await {
            if client_write
                .write_all(format!("{frame}\n").as_bytes())
                .await
                .is_err()
            {
                return;
            }
        }
    });
    let down_seen = seen.clone();
    let down_client = to_client.clone();
    tokio::spawn(async move {
        let mut lines = BufReader::new(server_read).lines();
        let mut held: Option<Value> = None;
        while let Ok(Some(line)) = lines.next_line().await {
            let mut frame: Value = serde_json::from_str(&line).unwrap();
            if frame.get("event").is_some() {
                match wrong {
                    Wrong::NoEvents => {}
                    Wrong::EventsOutOfOrder if held.is_none() && frame["change"] == "opened" => {
                        held = Some(frame);
                    }
                    _ => {
                        let _ = down_client.send(frame);
                        if let Some(opened) = held.take() {
                            let _ = down_client.send(opened);
                        }
                    }
                }
                continue;
            }
            let request = frame["id"]
                .as_u64()
                .and_then(|id| down_seen.lock().unwrap().requests.get(&id).cloned())
                .unwrap_or(Value::Null);
            mangle_reply(wrong, &request, &mut frame, &mut down_seen.lock().unwrap());
            let _ = down_client.send(frame);
        }
    });
    let mut opens = Vec::new();
    let mut lines = BufReader::new(client_read).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        let mut request: Value = serde_json::from_str(&line).unwrap();
        if let Some(id) = request["id"].as_u64() {
            seen.lock().unwrap().requests.insert(id, request.clone());
        }
        match (wrong, request["op"].as_str()) {
            (Wrong::IgnoreStops, Some("modify")) => {
                request["sl"] = Value::Null;
                request["tp"] = Value::Null;
            }
            (Wrong::AmendIgnored, Some("amend")) => {
                let done = json!({"id": request["id"], "ok": true,
                                  "result": {"ticket": request["ticket"], "duplicate": false}});
                let _ = to_client.send(done);
                continue;
            }
            (Wrong::ReplayOnDrop, Some("open")) => opens.push(request.clone()),
            (Wrong::CloseIgnored, Some("close"))
                if request["volume"].is_null()
                    && !std::mem::replace(&mut seen.lock().unwrap().close_ignored, true) =>
            {
                let done = json!({"id": request["id"], "ok": true,
                                  "result": {"ticket": request["ticket"], "closed_volume": 0.0,
                                             "remaining_volume": 0.0, "price": 1.1,
                                             "duplicate": false}});
                let _ = to_client.send(done);
                continue;
            }
            (Wrong::OrdersInvalid, Some("orders")) => {
                let invalid = json!({"id": request["id"], "ok": false,
                                     "error": {"kind": "invalid", "reason": "unknown op orders"}});
                let _ = to_client.send(invalid);
                continue;
            }
            (Wrong::LogoutRefused, Some("logout")) => {
                let refused = json!({"id": request["id"], "ok": false,
                                     "error": {"kind": "rejected", "reason": "logout refused",
                                               "code": "rejected"}});
                let _ = to_client.send(refused);
                continue;
            }
            _ => {}
        }
        if server_write
            .write_all(format!("{request}\n").as_bytes())
            .await
            .is_err()
        {
            return;
        }
    }
    // The client is gone: a bridge that "makes sure" sends its orders again.
    for mut open in opens {
        open["client_order_id"] = json!(format!("{}-again", open["client_order_id"]));
        let _ = send_alone(upstream, open).await;
    }
}

/// `request` on a connection of its own (after `hello`); waits for its reply.
async fn send_alone(upstream: SocketAddr, request: Value) -> std::io::Result<()> {
    let stream = TcpStream::connect(upstream).await?;
    let (read, mut write) = stream.into_split();
    let hello = json!({"id": 1, "op": "hello", "client": "double", "protocol": 1});
    let mut request = request;
    request["id"] = json!(2);
    write
        .write_all(format!("{hello}\n{request}\n").as_bytes())
        .await?;
    let mut lines = BufReader::new(read).lines();
    while let Some(line) = lines.next_line().await? {
        if serde_json::from_str::<Value>(&line).is_ok_and(|f| f["id"] == 2) {
            break;
        }
    }
    Ok(())
}

fn mangle_reply(wrong: Wrong, request: &Value, reply: &mut Value, seen: &mut Seen) {
    let op = request["op"].as_str().unwrap_or("");
    let result = &mut reply["result"];
    match (wrong, op) {
        (Wrong::Protocol, "hello") => result["protocol"] = json!(2),
        (Wrong::ZeroStep, "symbols") => {
            for s in result["symbols"].as_array_mut().into_iter().flatten() {
                s["volume_step"] = json!(0.0);
            }
        }
        (Wrong::StripComment, "positions") => {
            for p in result["positions"].as_array_mut().into_iter().flatten() {
                p["comment"] = json!("");
            }
        }
        (Wrong::PartialLosesMarker, "close")
            if result["remaining_volume"].as_f64().is_some_and(|v| v > 0.0) =>
        {
            seen.partial.insert(request["ticket"].as_i64().unwrap_or(0));
        }
        (Wrong::PartialLosesMarker, "positions") => {
            for p in result["positions"].as_array_mut().into_iter().flatten() {
                if p["ticket"]
                    .as_i64()
                    .is_some_and(|t| seen.partial.contains(&t))
                {
                    p["comment"] = json!("");
                }
            }
        }
        (Wrong::NoHistory, "history") => result["history"] = json!([]),
        (Wrong::NoFence, "login") => {
            if let Some(r) = result.as_object_mut() {
                r.remove("fence");
            }
        }
        (Wrong::BadCurrency, "account") => result["currency"] = json!("usd"),
        (Wrong::NoCodes, _) => {
            if let Some(error) = reply.get_mut("error").and_then(Value::as_object_mut) {
                error.remove("code");
            }
        }
        _ => {}
    }
}

#[tokio::test]
async fn each_wrong_bridge_fails_the_check_for_what_it_gets_wrong() {
    let wrongs = [
        Wrong::Protocol,
        Wrong::ZeroStep,
        Wrong::StripComment,
        Wrong::PartialLosesMarker,
        Wrong::IgnoreStops,
        Wrong::NoHistory,
        Wrong::NoEvents,
        Wrong::NoCodes,
        Wrong::ReplayOnDrop,
        Wrong::AmendIgnored,
        Wrong::NoFence,
        Wrong::BadCurrency,
        Wrong::CloseIgnored,
        Wrong::LogoutRefused,
        Wrong::EventsOutOfOrder,
    ];
    // Every check the kit makes is shown to fail by one of them.
    let shown: HashSet<&str> = wrongs.iter().map(|w| w.check()).collect();
    for check in CHECKS {
        assert!(shown.contains(&check), "no wrong bridge fails {check}");
    }
    let dir = Scratch::new("bridge-check-doubles");
    let sim = broker(&dir, |_| {}).await;
    // Each double relays everything else as it is, so the checks before its wrong pass.
    for wrong in wrongs {
        let report = check(double(sim.addr, wrong).await).await;
        let failed = report.check(wrong.check()).unwrap();
        assert_eq!(
            failed.result,
            Outcome::Failed,
            "{wrong:?} should fail {}: {}",
            wrong.check(),
            report.text()
        );
        assert!(!report.passed, "{wrong:?}");
        if wrong == Wrong::EventsOutOfOrder {
            assert!(failed.detail.contains("out of order"), "{}", failed.detail);
        }
        if wrong != Wrong::Protocol {
            assert_eq!(
                report.check("hello").unwrap().result,
                Outcome::Passed,
                "{wrong:?}: {}",
                report.text()
            );
        }
        // Only what the double gets wrong (and what needs it) fails: the refusals need nothing
        // before them but the login and the symbols.
        if !matches!(
            wrong,
            Wrong::Protocol | Wrong::ZeroStep | Wrong::NoCodes | Wrong::NoFence
        ) {
            assert_eq!(
                report.check("refusals").unwrap().result,
                Outcome::Passed,
                "{wrong:?}: {}",
                report.text()
            );
        }
    }
    sim.stop().await;
}

/// A bridge that offers no pending orders (`orders` answered as invalid, as by a bridge older
/// than them) passes: the check says "not offered", and every other check still runs.
#[tokio::test]
async fn a_bridge_without_pending_orders_passes_with_pending_not_offered() {
    let dir = Scratch::new("bridge-check-no-pending");
    let sim = broker(&dir, |_| {}).await;
    let report = check(double(sim.addr, Wrong::OrdersInvalid).await).await;
    assert!(report.passed, "{}", report.text());
    for c in &report.checks {
        let want = if c.check == "pending" {
            Outcome::NotOffered
        } else {
            Outcome::Passed
        };
        assert_eq!(c.result, want, "{}: {}", c.check, report.text());
    }
    sim.stop().await;
}

#[tokio::test]
async fn the_command_prints_json_and_exits_by_the_outcome() {
    let dir = Scratch::new("bridge-check-command");
    let sim = broker(&dir, |_| {}).await;
    let run = async |server: &str, extra: &[&str]| {
        let out = tokio::process::Command::new(binary())
            .args(["bridge-check", "--server", server, "--login", "4002"])
            .args(extra)
            .stdin(Stdio::null())
            .output()
            .await
            .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let good = sim.addr.to_string();
    let (code, stdout, stderr) = run(&good, &["--json", "--timeout", "2s"]).await;
    assert_eq!(code, 0, "{stdout}{stderr}");
    let report: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(report["passed"], true);
    assert_eq!(report["checks"].as_array().unwrap().len(), CHECKS.len());

    let wrong = double(sim.addr, Wrong::NoCodes).await;
    let (code, stdout, stderr) = run(&wrong, &["--timeout", "2s"]).await;
    assert_eq!(code, 1, "{stdout}{stderr}");
    assert!(stdout.contains("FAILED"), "{stdout}");
    assert!(
        stderr.contains("refusals") && stderr.contains(&wrong),
        "{stderr}"
    );

    let (code, _, stderr) = run(&good, &["--timeout", "soon"]).await;
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("--timeout"), "{stderr}");
    sim.stop().await;
}
