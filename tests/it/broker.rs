//! The simulated broker and the bridge client: protocol round trips, rejections, the journal,
//! state across restarts, reconnects, idempotent retries, shared position streams, and many
//! sessions on one connection.

use std::time::Duration;

use copier_node::broker::client::BridgeClient;
use copier_node::broker::types::{
    CloseOrder, ClosedBy, ModifyOrder, OpenOrder, PositionChange, Side,
};
use copier_node::broker::{
    AccountLogin, Broker, BrokerError, RejectCode, Rejection, Session, SessionEvent,
};
use copier_node::config::Secret;
use copier_node::sim_broker::{ServeOptions, SimBroker};

use crate::support::broker::{BrokerProcess, Scratch, free_port, journal, start_sim, tool};
use crate::support::chaos::{ChaosProxy, Mode};

fn account(login: &str, fence: Option<i64>) -> AccountLogin {
    AccountLogin {
        login: login.into(),
        password: None,
        fence,
        account_id: None,
    }
}

fn buy(symbol: &str, volume: f64, coid: Option<&str>) -> OpenOrder {
    OpenOrder {
        symbol: symbol.into(),
        side: Side::Buy,
        volume,
        sl: None,
        tp: None,
        magic: 100_001,
        comment: "mc42".into(),
        client_order_id: coid.map(Into::into),
        price_limit: None,
    }
}

async fn next_change(session: &mut Session) -> PositionChange {
    loop {
        match tokio::time::timeout(Duration::from_secs(5), session.events.recv()).await {
            Ok(Some(SessionEvent::Position(c))) => return c,
            Ok(Some(_)) => continue,
            other => panic!("no position event: {other:?}"),
        }
    }
}

#[tokio::test]
async fn every_request_round_trips_and_a_partial_close_keeps_the_ticket() {
    let dir = Scratch::new("broker-rt");
    let server = start_sim(&dir).await;
    let client = BridgeClient::connect(server.addr.to_string(), "node-a");
    let mut s = client.login(&account("1001", Some(7))).await.unwrap();
    assert_eq!(s.account.balance, 10_000.0);
    let symbols = s.api.symbols().await.unwrap();
    assert!(symbols.iter().any(|x| x.symbol == "EURUSD.m"
        && x.volume_step == 0.01
        && x.volume_min == 0.01
        && x.volume_max == 100.0));

    let fill = s
        .api
        .open(OpenOrder {
            sl: Some(1.09),
            tp: Some(1.2),
            ..buy("EURUSD", 1.0, Some("l1-m42-open"))
        })
        .await
        .unwrap();
    assert_eq!(fill.price, 1.1);
    assert!(!fill.duplicate);
    let PositionChange::Opened { position } = next_change(&mut s).await else {
        panic!("opened expected")
    };
    assert_eq!(
        (position.ticket, position.magic, position.comment.as_str()),
        (fill.ticket, 100_001, "mc42")
    );

    let part = s
        .api
        .close(CloseOrder {
            ticket: fill.ticket,
            volume: Some(0.4),
            client_order_id: None,
        })
        .await
        .unwrap();
    assert_eq!(
        (part.ticket, part.closed_volume, part.remaining_volume),
        (fill.ticket, 0.4, 0.6)
    );
    let PositionChange::PartiallyClosed { position, closed } = next_change(&mut s).await else {
        panic!("partial close expected")
    };
    assert_eq!(
        (position.ticket, position.volume, closed.position.volume),
        (fill.ticket, 0.6, 0.4)
    );

    s.api
        .modify(ModifyOrder {
            ticket: fill.ticket,
            sl: Some(1.05),
            tp: None,
            client_order_id: None,
        })
        .await
        .unwrap();
    let PositionChange::Modified { position } = next_change(&mut s).await else {
        panic!("modified expected")
    };
    assert_eq!((position.sl, position.tp), (Some(1.05), None));

    let open = s.api.positions().await.unwrap();
    assert_eq!(open.len(), 1);
    assert_eq!(
        (open[0].ticket, open[0].volume),
        (fill.ticket, 0.6),
        "the ticket survives the partial close"
    );

    s.api
        .close(CloseOrder {
            ticket: fill.ticket,
            volume: None,
            client_order_id: None,
        })
        .await
        .unwrap();
    assert!(matches!(
        next_change(&mut s).await,
        PositionChange::Closed { .. }
    ));
    assert!(s.api.positions().await.unwrap().is_empty());
    let history = s.api.history().await.unwrap();
    assert_eq!(history.len(), 2);
    assert!(
        history
            .iter()
            .all(|h| h.position.ticket == fill.ticket && h.closed_by == ClosedBy::Client)
    );
    assert_eq!(history[1].remaining_volume, 0.0);
    let info = s.api.account().await.unwrap();
    assert_eq!(info.balance, info.equity);
    server.stop().await;
}

#[tokio::test]
async fn each_rejection_has_its_reason_and_is_journaled() {
    let dir = Scratch::new("broker-rej");
    let server = start_sim(&dir).await;
    let client = BridgeClient::connect(server.addr.to_string(), "node-a");
    let s = client.login(&account("2002", Some(10))).await.unwrap();
    let mut limited = buy("EURUSD", 0.1, None);
    limited.price_limit = Some(1.0);
    let mut bad_stop = buy("EURUSD", 0.1, None);
    bad_stop.sl = Some(1.2);
    let cases: Vec<(OpenOrder, &str, RejectCode)> = vec![
        (
            buy("BTCUSD", 1.0, None),
            "unknown symbol BTCUSD",
            RejectCode::UnknownSymbol,
        ),
        (
            buy("EURUSD", 0.015, None),
            "not a multiple of the step",
            RejectCode::InvalidVolume,
        ),
        (
            buy("EURUSD", 0.001, None),
            "below the minimum",
            RejectCode::InvalidVolume,
        ),
        (
            buy("EURUSD", 101.0, None),
            "above the maximum",
            RejectCode::InvalidVolume,
        ),
        (bad_stop, "invalid stops", RejectCode::InvalidStops),
        (
            limited,
            "beyond the order's price limit",
            RejectCode::Slippage,
        ),
    ];
    for (order, why, code) in cases {
        match s.api.open(order).await {
            Err(BrokerError::Rejected(r)) => {
                assert!(r.reason.contains(why), "{r:?}");
                assert_eq!(r.code, code, "{why}");
            }
            other => panic!("{why}: {other:?}"),
        }
    }
    let err = s
        .api
        .close(CloseOrder {
            ticket: 999,
            volume: None,
            client_order_id: None,
        })
        .await
        .unwrap_err();
    assert_eq!(
        err,
        BrokerError::Rejected(Rejection::new(
            RejectCode::UnknownTicket,
            "unknown ticket 999"
        ))
    );

    // A stale fence, at login and on an order of the older session.
    let other = BridgeClient::connect(server.addr.to_string(), "node-b");
    let err = other.login(&account("2002", Some(9))).await.unwrap_err();
    assert!(
        matches!(&err, BrokerError::Rejected(r) if r.reason.contains("stale fence 9") && r.code == RejectCode::StaleFence),
        "{err:?}"
    );
    let _newer = other.login(&account("2002", Some(11))).await.unwrap();
    let err = s.api.open(buy("EURUSD", 0.1, None)).await.unwrap_err();
    assert!(
        matches!(&err, BrokerError::Rejected(r) if r.reason.contains("stale fence 10") && r.code == RejectCode::StaleFence),
        "{err:?}"
    );

    let lines = journal(&dir.path("journal.jsonl"));
    let rejected: Vec<&str> = lines
        .iter()
        .filter(|l| !l.accepted)
        .map(|l| l.reason.as_deref().unwrap())
        .collect();
    for why in [
        "unknown symbol",
        "multiple of the step",
        "below the minimum",
        "above the maximum",
        "unknown ticket 999",
        "stale fence 9",
        "stale fence 10",
    ] {
        assert!(
            rejected.iter().any(|r| r.contains(why)),
            "{why} not journaled: {rejected:?}"
        );
    }
    let stale_login = lines
        .iter()
        .find(|l| l.action == "login" && l.fence == Some(9))
        .unwrap();
    assert_eq!(stale_login.client, "node-b");
    assert!(!stale_login.accepted);
    server.stop().await;
}

#[tokio::test]
async fn the_journal_is_one_flushed_json_line_per_request() {
    let dir = Scratch::new("broker-journal");
    let server = start_sim(&dir).await;
    let client = BridgeClient::connect(server.addr.to_string(), "node-j");
    let s = client.login(&account("3003", Some(1))).await.unwrap();
    let mut expected = 1; // the login
    for i in 0..20 {
        let r = s
            .api
            .open(buy(
                if i % 5 == 4 { "NOPE" } else { "GBPUSD" },
                0.01,
                Some(&format!("c{i}")),
            ))
            .await;
        assert_eq!(r.is_ok(), i % 5 != 4);
        expected += 1;
        // Read back while the server runs: the line is there before the reply arrived.
        let lines = journal(&dir.path("journal.jsonl"));
        assert_eq!(lines.len(), expected);
    }
    let _ = s.api.positions().await.unwrap(); // reads are not journaled
    assert_eq!(journal(&dir.path("journal.jsonl")).len(), expected);
    // The wire format itself (docs/design/bridge-protocol.md): every key always present, numbers as numbers.
    let text = std::fs::read_to_string(dir.path("journal.jsonl")).unwrap();
    for line in text.lines() {
        let l: serde_json::Value = serde_json::from_str(line).unwrap();
        let keys: Vec<&String> = l.as_object().unwrap().keys().collect();
        assert_eq!(keys.len(), 15, "{l}");
        assert!(l["ts_ms"].is_i64() && l["fence"].is_i64(), "{l}");
        // ts_us is the same instant on the same clock, a thousand times finer.
        let (ms, us) = (l["ts_ms"].as_i64().unwrap(), l["ts_us"].as_i64().unwrap());
        assert_eq!(us / 1000, ms, "{l}");
        if l["action"] == "open" && l["accepted"] == true {
            assert!(
                l["ticket"].is_i64() && l["volume"].is_f64() && l["magic"].is_i64(),
                "{l}"
            );
            assert_eq!(l["client"], "node-j");
        }
    }
    server.stop().await;
}

#[tokio::test]
async fn a_restarted_server_with_state_keeps_positions_history_and_fences() {
    let dir = Scratch::new("broker-state");
    let options = || ServeOptions {
        state: Some(dir.path("state.jsonl")),
        ..ServeOptions::new("127.0.0.1:0", dir.path("journal.jsonl"))
    };
    let server = SimBroker::start(options()).await.unwrap();
    let client = BridgeClient::connect(server.addr.to_string(), "node-a");
    let s = client.login(&account("4004", Some(20))).await.unwrap();
    let a = s.api.open(buy("XAUUSD", 0.5, Some("x1"))).await.unwrap();
    let b = s
        .api
        .open(OpenOrder {
            side: Side::Sell,
            ..buy("USDJPY", 1.0, None)
        })
        .await
        .unwrap();
    s.api
        .close(CloseOrder {
            ticket: a.ticket,
            volume: Some(0.2),
            client_order_id: None,
        })
        .await
        .unwrap();
    s.api
        .close(CloseOrder {
            ticket: b.ticket,
            volume: None,
            client_order_id: None,
        })
        .await
        .unwrap();
    let positions = s.api.positions().await.unwrap();
    let history = s.api.history().await.unwrap();
    drop(s);
    client.close();
    server.stop().await;

    let server = SimBroker::start(options()).await.unwrap();
    let client = BridgeClient::connect(server.addr.to_string(), "node-b");
    let err = client.login(&account("4004", Some(19))).await.unwrap_err();
    assert!(
        matches!(&err, BrokerError::Rejected(r) if r.reason.contains("stale fence 19")),
        "the fence survived: {err:?}"
    );
    let s = client.login(&account("4004", Some(21))).await.unwrap();
    assert_eq!(s.api.positions().await.unwrap(), positions);
    assert_eq!(s.api.history().await.unwrap(), history);
    // An executed client order id is remembered too, and new tickets do not collide.
    assert!(
        s.api
            .open(buy("XAUUSD", 0.5, Some("x1")))
            .await
            .unwrap()
            .duplicate
    );
    let c = s.api.open(buy("EURUSD", 0.1, None)).await.unwrap();
    assert!(c.ticket > b.ticket);
    server.stop().await;
}

#[tokio::test]
async fn the_client_reconnects_after_the_server_restarts_and_logs_sessions_in_again() {
    let dir = Scratch::new("broker-reconnect");
    let port = free_port();
    let mut server = BrokerProcess::spawn_on(
        &dir,
        port,
        &["--state", dir.path("state.jsonl").to_str().unwrap()],
    )
    .await;
    let client = BridgeClient::connect(server.addr.clone(), "node-r");
    let mut s = client.login(&account("5005", Some(3))).await.unwrap();
    s.api.open(buy("EURUSD", 0.1, None)).await.unwrap();
    server.stop();
    // While it is down, nothing is sent.
    let err = s.api.open(buy("EURUSD", 0.1, None)).await.unwrap_err();
    assert!(
        matches!(err, BrokerError::Unavailable(_) | BrokerError::Unknown(_)),
        "{err:?}"
    );
    let _server = BrokerProcess::spawn_on(
        &dir,
        port,
        &["--state", dir.path("state.jsonl").to_str().unwrap()],
    )
    .await;
    loop {
        match tokio::time::timeout(Duration::from_secs(15), s.events.recv()).await {
            Ok(Some(SessionEvent::Reconnected)) => break,
            Ok(Some(_)) => continue,
            other => panic!("no reconnect: {other:?}"),
        }
    }
    assert_eq!(s.api.positions().await.unwrap().len(), 1);
    s.api.open(buy("EURUSD", 0.1, None)).await.unwrap();
    let logins: Vec<_> = journal(&dir.path("journal.jsonl"))
        .into_iter()
        .filter(|l| l.action == "login")
        .collect();
    assert_eq!(
        logins.len(),
        2,
        "logged in again after the restart, with its fence"
    );
    assert!(logins.iter().all(|l| l.fence == Some(3)));
}

#[tokio::test]
async fn a_retried_order_after_a_lost_reply_opens_one_position() {
    let dir = Scratch::new("broker-lost");
    let server = start_sim(&dir).await;
    let proxy = ChaosProxy::start(server.addr.to_string()).await;
    let client = BridgeClient::with_timeout(
        format!("127.0.0.1:{}", proxy.port),
        "node-l",
        // Long enough for every other request on a loaded machine; only the lost reply waits
        // it out.
        Duration::from_secs(2),
    );
    let s = client.login(&account("6006", Some(1))).await.unwrap();
    proxy.set(Mode::HangReplies);
    let err = s
        .api
        .open(buy("EURUSD", 0.3, Some("l9-m77-open")))
        .await
        .unwrap_err();
    assert!(
        matches!(err, BrokerError::Unknown(_)),
        "a lost reply is an unknown outcome: {err:?}"
    );
    proxy.set(Mode::Forward);
    let retry = s
        .api
        .open(buy("EURUSD", 0.3, Some("l9-m77-open")))
        .await
        .unwrap();
    assert!(retry.duplicate, "the server recognised the client order id");
    let positions = s.api.positions().await.unwrap();
    assert_eq!(positions.len(), 1);
    assert_eq!(positions[0].ticket, retry.ticket);
    let opens: Vec<_> = journal(&dir.path("journal.jsonl"))
        .into_iter()
        .filter(|l| l.action == "open")
        .collect();
    assert_eq!(opens.len(), 2);
    assert_eq!(
        opens.iter().filter(|l| l.accepted).count(),
        1,
        "one accepted open"
    );
    server.stop().await;
}

#[tokio::test]
async fn two_clients_on_one_login_see_each_others_changes() {
    let dir = Scratch::new("broker-share");
    let server = start_sim(&dir).await;
    let a = BridgeClient::connect(server.addr.to_string(), "node-a");
    let b = BridgeClient::connect(server.addr.to_string(), "node-b");
    let mut sa = a.login(&account("7007", Some(1))).await.unwrap();
    let mut sb = b.login(&account("7007", Some(1))).await.unwrap();
    let fill = sa.api.open(buy("EURUSD", 0.2, None)).await.unwrap();
    assert!(matches!(
        next_change(&mut sa).await,
        PositionChange::Opened { .. }
    ));
    assert!(
        matches!(next_change(&mut sb).await, PositionChange::Opened { position } if position.ticket == fill.ticket)
    );
    sb.api
        .close(CloseOrder {
            ticket: fill.ticket,
            volume: None,
            client_order_id: None,
        })
        .await
        .unwrap();
    assert!(matches!(
        next_change(&mut sb).await,
        PositionChange::Closed { .. }
    ));
    assert!(
        matches!(next_change(&mut sa).await, PositionChange::Closed { closed } if closed.position.ticket == fill.ticket)
    );
    // A hand trade shows up too.
    let (code, stdout, _) = tool(&[
        "trade",
        "--broker",
        &server.addr.to_string(),
        "--login",
        "7007",
        "open",
        "GBPUSD",
        "sell",
        "0.05",
    ])
    .await;
    assert_eq!(code, 0);
    let ticket: i64 = stdout.trim().parse().unwrap();
    assert!(
        matches!(next_change(&mut sa).await, PositionChange::Opened { position } if position.ticket == ticket)
    );
    server.stop().await;
}

#[tokio::test]
async fn credentials_are_checked_and_never_journaled() {
    let dir = Scratch::new("broker-cred");
    let server = start_sim(&dir).await;
    let client = BridgeClient::connect(server.addr.to_string(), "node-c");
    let with = |pw: &str| AccountLogin {
        login: "8008".into(),
        password: Some(Secret::new(pw)),
        fence: Some(1),
        account_id: None,
    };
    client.login(&with("hunter2")).await.unwrap();
    let err = client.login(&with("wrong")).await.unwrap_err();
    assert_eq!(
        err,
        BrokerError::Rejected(Rejection::new(
            RejectCode::InvalidCredentials,
            "invalid credentials"
        ))
    );
    let text = std::fs::read_to_string(dir.path("journal.jsonl")).unwrap();
    assert!(!text.contains("hunter2") && !text.contains("wrong"));
    server.stop().await;
}

#[tokio::test]
async fn hand_tools_open_close_modify_and_list() {
    let dir = Scratch::new("broker-tools");
    let server = BrokerProcess::spawn(&dir, &[]).await;
    let b = server.addr.as_str();
    let (code, stdout, stderr) = tool(&[
        "trade", "--broker", b, "--login", "9009", "open", "EURUSD", "buy", "1.5", "--sl", "1.05",
        "--tp", "1.15",
    ])
    .await;
    assert_eq!(code, 0, "{stderr}");
    let ticket: i64 = stdout.trim().parse().expect("open prints only the ticket");
    assert_eq!(stdout, format!("{ticket}\n"));
    let (code, stdout, _) = tool(&[
        "trade",
        "--broker",
        b,
        "--login",
        "9009",
        "close",
        &ticket.to_string(),
        "--volume",
        "0.5",
    ])
    .await;
    assert_eq!((code, stdout.as_str()), (0, ""));
    let (code, _, _) = tool(&[
        "trade",
        "--broker",
        b,
        "--login",
        "9009",
        "modify",
        &ticket.to_string(),
        "--sl",
        "1.0",
        "--tp",
        "1.2",
    ])
    .await;
    assert_eq!(code, 0);
    let (code, stdout, _) = tool(&["positions", "--broker", b, "--login", "9009"]).await;
    assert_eq!(code, 0);
    let lines: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 1);
    for key in [
        "ticket",
        "symbol",
        "side",
        "volume",
        "open_price",
        "sl",
        "tp",
        "magic",
        "comment",
        "open_time_ms",
    ] {
        assert!(lines[0].get(key).is_some(), "positions lacks {key}");
    }
    assert_eq!(
        (
            lines[0]["ticket"].as_i64(),
            lines[0]["volume"].as_f64(),
            lines[0]["sl"].as_f64()
        ),
        (Some(ticket), Some(1.0), Some(1.0))
    );
    let (_, stdout, _) = tool(&["history", "--broker", b, "--login", "9009"]).await;
    let h: serde_json::Value = serde_json::from_str(stdout.lines().next().unwrap()).unwrap();
    assert_eq!(
        (
            h["ticket"].as_i64(),
            h["volume"].as_f64(),
            h["closed_by"].as_str()
        ),
        (Some(ticket), Some(0.5), Some("manual"))
    );
    assert!(h["close_time_ms"].is_i64());

    let (code, stdout, stderr) = tool(&[
        "trade", "--broker", b, "--login", "9009", "open", "EURUSD", "buy", "0.001",
    ])
    .await;
    assert_ne!(code, 0);
    assert!(
        stdout.is_empty() && stderr.contains("below the minimum"),
        "{stderr}"
    );
    let (code, _, stderr) = tool(&[
        "trade",
        "--broker",
        "127.0.0.1:1",
        "--login",
        "1",
        "open",
        "EURUSD",
        "buy",
        "1",
    ])
    .await;
    assert_ne!(code, 0);
    assert!(stderr.contains("127.0.0.1:1"), "{stderr}");
    let j = journal(&dir.path("journal.jsonl"));
    assert!(j.iter().all(|l| l.client == "manual" && l.fence.is_none()));
}

#[tokio::test]
async fn ten_thousand_sessions_share_one_connection() {
    let dir = Scratch::new("broker-many");
    let server = BrokerProcess::spawn(&dir, &[]).await;
    let client = BridgeClient::connect(server.addr.clone(), "node-many");
    client.wait_ready(Duration::from_secs(10)).await.unwrap();
    let rss = || -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
        line.split_whitespace()
            .nth(1)
            .unwrap()
            .parse::<u64>()
            .unwrap()
            * 1024
    };
    let before = rss();
    const N: usize = 10_000;
    let mut sessions = Vec::with_capacity(N);
    for start in (0..N).step_by(200) {
        let mut handles = Vec::new();
        for i in start..(start + 200).min(N) {
            let client = client.clone();
            handles.push(tokio::spawn(async move {
                client.login(&account(&format!("m{i}"), Some(1))).await
            }));
        }
        for h in handles {
            sessions.push(h.await.unwrap().unwrap());
        }
    }
    let after = rss();
    assert_eq!(client.session_count(), N);
    let per_session = after.saturating_sub(before) / N as u64;
    eprintln!(
        "{N} sessions on one connection: {} KiB resident in all, {per_session} bytes per session",
        after.saturating_sub(before) / 1024
    );
    assert!(per_session < 64 * 1024, "{per_session} bytes per session");
    // The stream still reaches the right session.
    let (code, _, _) = tool(&[
        "trade",
        "--broker",
        &server.addr,
        "--login",
        "m4321",
        "open",
        "EURUSD",
        "buy",
        "0.01",
    ])
    .await;
    assert_eq!(code, 0);
    let s = &mut sessions[4321];
    assert!(matches!(
        next_change(s).await,
        PositionChange::Opened { .. }
    ));
    assert!(sessions[4322].events.try_recv().is_err());
}

/// Two sessions of one login on one connection both receive the login's position changes; when
/// one is dropped the other still does, and another login's changes reach neither.
#[tokio::test]
async fn sessions_of_one_login_on_one_connection_each_get_its_changes_until_dropped() {
    let dir = Scratch::new("broker-same-login");
    let server = BrokerProcess::spawn(&dir, &[]).await;
    let client = BridgeClient::connect(server.addr.clone(), "node-x");
    client.wait_ready(Duration::from_secs(10)).await.unwrap();
    let mut a = client.login(&account("m1", Some(1))).await.unwrap();
    let mut b = client.login(&account("m1", Some(1))).await.unwrap();
    let mut other = client.login(&account("m2", Some(1))).await.unwrap();
    let open = async |login: &str| {
        let (code, _, _) = tool(&[
            "trade",
            "--broker",
            &server.addr,
            "--login",
            login,
            "open",
            "EURUSD",
            "buy",
            "0.01",
        ])
        .await;
        assert_eq!(code, 0);
    };
    open("m1").await;
    for s in [&mut a, &mut b] {
        assert!(matches!(
            next_change(s).await,
            PositionChange::Opened { .. }
        ));
    }
    drop(a);
    open("m1").await;
    assert!(matches!(
        next_change(&mut b).await,
        PositionChange::Opened { .. }
    ));
    assert_eq!(client.session_count(), 2);
    // m2's stream carried nothing of m1's.
    open("m2").await;
    assert!(matches!(
        next_change(&mut other).await,
        PositionChange::Opened { .. }
    ));
    assert!(other.events.try_recv().is_err(), "only m2's own change");
    assert!(b.events.try_recv().is_err(), "nothing of m2's");
}

/// A prepared hand-off at the broker, with the fence check on: the new owner's login ahead of its
/// claim raises nothing (the old owner's orders still pass), the `fence` request raises the
/// fence (journaled as a `login` line; from then on the old owner's orders are refused), a lower
/// raise is refused, the raised session trades with its fence, and a prepared login dropped
/// unraised ends. A bridge that predates `fence` refuses to prepare.
#[tokio::test]
async fn a_prepared_login_raises_nothing_until_its_fence_request() {
    let dir = Scratch::new("broker-prepared");
    let server = start_sim(&dir).await;
    let old = BridgeClient::connect(server.addr.to_string(), "node-old");
    let new = BridgeClient::connect(server.addr.to_string(), "node-new");
    let o = old.login(&account("4004", Some(5))).await.unwrap();
    o.api.open(buy("EURUSD", 0.1, Some("o1"))).await.unwrap();

    // Logged in ahead of the claim (the fence asked for is ignored: a prepared login has none).
    let prepared = new.prepare(&account("4004", Some(6))).await.unwrap();
    o.api
        .open(buy("EURUSD", 0.1, Some("o2")))
        .await
        .expect("the old owner still trades while the new one prepares");

    // A raise below the fence held is refused and changes nothing.
    let low = new.prepare(&account("4004", None)).await.unwrap();
    let err = low.raise(4).await.expect_err("a lower raise is refused");
    assert!(
        matches!(&err, BrokerError::Rejected(r) if r.code == RejectCode::StaleFence),
        "{err:?}"
    );
    o.api.open(buy("EURUSD", 0.1, Some("o3"))).await.unwrap();

    // The claim raises the fence: the old owner is fenced out from then on.
    let mut raised = prepared.raise(6).await.unwrap();
    let err = o
        .api
        .open(buy("EURUSD", 0.1, Some("o4")))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, BrokerError::Rejected(r) if r.code == RejectCode::StaleFence),
        "{err:?}"
    );
    let mine = raised
        .api
        .open(buy("EURUSD", 0.1, Some("n1")))
        .await
        .unwrap();
    // Its position stream is the session's: the first change it hears is its own open (what
    // the stream carried while prepared, the old owner's opens, is older than the session's
    // first reads and was dropped at the raise).
    let first = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match raised.events.recv().await {
                Some(SessionEvent::Position(change)) => break change,
                Some(_) => continue,
                None => panic!("stream ended"),
            }
        }
    })
    .await
    .expect("the raised session hears its account's changes");
    assert!(
        matches!(&first, PositionChange::Opened { position } if position.ticket == mine.ticket),
        "{first:?}"
    );

    let lines = journal(&dir.path("journal.jsonl"));
    let by = |client: &str| -> Vec<(String, Option<i64>, bool)> {
        lines
            .iter()
            .filter(|l| l.client == client)
            .map(|l| (l.action.clone(), l.fence, l.accepted))
            .collect()
    };
    let open = |fence: i64, accepted: bool| ("open".to_string(), Some(fence), accepted);
    let login = |fence: Option<i64>, accepted: bool| ("login".to_string(), fence, accepted);
    assert_eq!(
        by("node-old"),
        vec![
            login(Some(5), true),
            open(5, true),
            open(5, true),
            open(5, true),
            open(5, false)
        ]
    );
    assert_eq!(
        by("node-new"),
        vec![
            login(None, true),
            login(None, true),
            login(Some(4), false),
            login(Some(6), true),
            open(6, true),
        ]
    );

    // A prepared login dropped unraised ends its session (as the refused one did): only the
    // raised one is left.
    let spare = new.prepare(&account("4004", None)).await.unwrap();
    assert_eq!(new.session_count(), 2);
    drop(spare);
    let since = tokio::time::Instant::now();
    while new.session_count() != 1 {
        assert!(
            since.elapsed() < Duration::from_secs(10),
            "never logged out"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    server.stop().await;

    // A bridge without the `fence` request: no preparation, the usual login still works.
    let dir = Scratch::new("broker-prepared-old-bridge");
    let server = SimBroker::start(ServeOptions {
        fence_request: false,
        ..ServeOptions::new("127.0.0.1:0", dir.path("journal.jsonl"))
    })
    .await
    .unwrap();
    let client = BridgeClient::connect(server.addr.to_string(), "node-x");
    let err = client.prepare(&account("5005", None)).await.err().unwrap();
    assert!(
        matches!(&err, BrokerError::Rejected(r) if r.code == RejectCode::InvalidRequest),
        "{err:?}"
    );
    client.login(&account("5005", Some(1))).await.unwrap();
    assert!(
        journal(&dir.path("journal.jsonl"))
            .iter()
            .all(|l| l.fence == Some(1)),
        "nothing was logged in without a fence"
    );
    server.stop().await;
}

/// A prepared login's read ahead, brought current at the raise from what its stream carried, is
/// the account as a fresh read shows it after the raise, over the wire: with changes made before
/// the prepared login (in the read), between the login and the read (in both), and between the
/// read and the raise (on the stream alone): opens, partial and full closes, a stop change, and
/// pending orders placed, cancelled and left resting. Both of the broker's orders of a reply and
/// the updates it caused, and slow reads.
#[tokio::test]
async fn a_prepared_logins_read_ahead_is_the_account_at_the_raise() {
    use copier_node::broker::types::{CancelOrder, PendingKind, PlaceOrder};
    for reply_first in [false, true] {
        let dir = Scratch::new(&format!("broker-read-ahead-{reply_first}"));
        let mut options = ServeOptions::new("127.0.0.1:0", dir.path("journal.jsonl"));
        options.reply_first = reply_first;
        options.read_delay = Duration::from_millis(30);
        let server = SimBroker::start(options).await.unwrap();
        let addr = server.addr.to_string();
        let old = BridgeClient::connect(addr.clone(), "node-old");
        let new = BridgeClient::connect(addr.clone(), "node-new");
        let o = old.login(&account("4005", Some(5))).await.unwrap();
        let api = o.api.clone();
        let close = |ticket: i64, volume: Option<f64>| CloseOrder {
            ticket,
            volume,
            client_order_id: None,
        };
        let place = |price: f64| PlaceOrder {
            symbol: "EURUSD".into(),
            side: Side::Buy,
            kind: PendingKind::Limit,
            price,
            volume: 0.1,
            sl: None,
            tp: None,
            expiry_ms: None,
            magic: 100_001,
            comment: "mc43".into(),
            client_order_id: None,
        };
        // Before the prepared login: in the read only.
        let a = api.open(buy("EURUSD", 0.5, None)).await.unwrap();
        let gone = api.place(place(1.05)).await.unwrap();

        let mut prepared = new.prepare(&account("4005", Some(6))).await.unwrap();
        // Between the login and the read: on the stream, and in the read too.
        api.close(close(a.ticket, Some(0.1))).await.unwrap();
        let b = api.open(buy("GBPUSD", 0.3, None)).await.unwrap();
        prepared.read_ahead().await.unwrap();
        // Between the read and the raise: on the stream alone.
        api.close(close(a.ticket, Some(0.2))).await.unwrap();
        api.modify(ModifyOrder {
            ticket: b.ticket,
            sl: Some(1.2),
            tp: None,
            client_order_id: None,
        })
        .await
        .unwrap();
        api.close(close(b.ticket, None)).await.unwrap();
        let c = api.open(buy("EURUSD", 0.2, None)).await.unwrap();
        api.cancel(CancelOrder {
            ticket: gone,
            client_order_id: None,
        })
        .await
        .unwrap();
        api.place(place(1.04)).await.unwrap();

        let raised = prepared.raise(6).await.unwrap();
        let ahead = raised
            .ahead
            .clone()
            .expect("read ahead, and its stream whole");
        // The truth: the account read after the raise, by another client.
        let check = BridgeClient::connect(addr.clone(), "checker");
        let s = check.login(&account("4005", None)).await.unwrap();
        let mut positions = s.api.positions().await.unwrap();
        let mut orders = s.api.orders().await.unwrap();
        let mut history = s.api.history().await.unwrap();
        let mut got = ahead.clone();
        for list in [&mut positions, &mut got.positions] {
            list.sort_by_key(|p| p.ticket);
        }
        for list in [&mut orders, &mut got.orders] {
            list.sort_by_key(|o| o.ticket);
        }
        for list in [&mut history, &mut got.history] {
            list.sort_by(|x, y| {
                (x.position.ticket, x.close_time_ms)
                    .cmp(&(y.position.ticket, y.close_time_ms))
                    .then(y.remaining_volume.total_cmp(&x.remaining_volume))
            });
        }
        let what = format!("reply_first {reply_first}");
        assert_eq!(got.positions, positions, "{what}");
        assert_eq!(got.orders, orders, "{what}");
        assert_eq!(got.history, history, "{what}");
        // What it holds: a's remainder and c open, two partial closes of a and b's close.
        let tickets: Vec<i64> = positions.iter().map(|p| p.ticket).collect();
        assert_eq!(tickets, vec![a.ticket, c.ticket], "{what}");
        assert_eq!(history.len(), 3, "{what}");
        assert!(!ahead.symbols.is_empty(), "{what}");
        drop((raised, s, o));
        server.stop().await;
    }
}
