//! Broker credentials encrypted at rest (docs/operating.md, Broker credentials): the node decrypts them only
//! with its key, puts an account whose credentials it cannot use in an error status and keeps
//! running, and no secret reaches a log line or `status`.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use copier_node::broker::AccountLogin;
use copier_node::broker::Broker;
use copier_node::broker::client::BridgeClient;
use copier_node::config::Secret;
use copier_node::credentials::CredentialsKey;
use sqlx::PgConnection;

use crate::support::broker::{Scratch, start_sim};
use crate::support::process::{NodeProcess, NodeSpec, binary, run_to_end};
use crate::support::{FAST, TestDb, add_account, eventually};

const WAIT: Duration = Duration::from_secs(30);

/// `copier-node credentials encrypt`, with the key in the environment and the password on stdin.
fn encrypt_with_the_cli(key: &CredentialsKey, password: &str) -> String {
    let mut child = Command::new(binary())
        .args(["credentials", "encrypt"])
        .env("COPIER_CREDENTIALS_KEY", key.encode())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    writeln!(child.stdin.take().unwrap(), "{password}").unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

async fn set_credentials(conn: &mut PgConnection, id: i64, value: &str) {
    sqlx::query("UPDATE trading_accounts SET credentials = $2 WHERE id = $1")
        .bind(id)
        .bind(value)
        .execute(conn)
        .await
        .unwrap();
}

async fn status_of(conn: &mut PgConnection, id: i64) -> String {
    sqlx::query_scalar::<_, Option<String>>("SELECT status FROM trading_accounts WHERE id = $1")
        .bind(id)
        .fetch_one(conn)
        .await
        .unwrap()
        .unwrap_or_default()
}

/// Waits until every account's status contains what `expected` says for it.
async fn wait_statuses(conn: &mut PgConnection, node: &str, expected: &[(i64, &str)]) {
    eventually(format!("{node}: statuses {expected:?}"), WAIT, async || {
        for (id, wants) in expected {
            if !status_of(conn, *id).await.contains(wants) {
                return None;
            }
        }
        Some(())
    })
    .await;
}

#[tokio::test]
async fn credentials_are_decrypted_only_with_the_nodes_key_and_never_shown() {
    let db = TestDb::new().await;
    let dir = Scratch::new("credentials");
    let broker = start_sim(&dir).await;
    let addr = broker.addr.to_string();
    // The simulated broker learns each account's password at its first login.
    let setup = BridgeClient::connect(addr.clone(), "setup");
    let passwords = ["pw-one-7001", "pw-two-7002", "pw-three-7003"];
    for (login, password) in ["7001", "7002", "7003"].iter().zip(passwords) {
        setup
            .login(&AccountLogin {
                login: login.to_string(),
                password: Some(Secret::new(password)),
                fence: None,
                account_id: None,
            })
            .await
            .unwrap();
    }
    setup.close();

    let key = CredentialsKey::generate();
    let other = CredentialsKey::generate();
    let sealed = encrypt_with_the_cli(&key, passwords[0]);
    let sealed_other = other.encrypt(passwords[2]);
    let mut conn = db.conn().await;
    for (id, login) in [(1, "7001"), (2, "7002"), (3, "7003"), (4, "7004")] {
        add_account(&mut conn, id, "master", &addr, login).await;
    }
    for (id, value) in [
        (1, sealed.as_str()),
        (2, passwords[1]), // stored in plaintext: refused, never sent
        (3, sealed_other.as_str()),
    ] {
        set_credentials(&mut conn, id, value).await;
    }

    // A node without the key: every account with credentials is in an error status saying why,
    // the one without credentials runs, and the node keeps running.
    let mut without = NodeProcess::spawn(&db, "nokey", 10, FAST, &[]);
    wait_statuses(
        &mut conn,
        "nokey",
        &[
            (1, "no credentials key"),
            (2, "no credentials key"),
            (3, "no credentials key"),
            (4, "master:"),
        ],
    )
    .await;
    assert!(
        status_of(&mut conn, 1)
            .await
            .starts_with("error: account 1 ")
    );
    without.signal("TERM");
    assert!(
        without.wait_exit(WAIT).await.success(),
        "{}",
        without.output()
    );

    // A node with the key (from a secrets file): account 1 logs in with its real password (the
    // broker refuses any other); the plaintext and the other key's value stay refused.
    let key_file = dir.path("credentials.key");
    std::fs::write(&key_file, format!("{}\n", key.encode())).unwrap();
    let mut with = NodeProcess::spawn_with(&NodeSpec {
        node_id: "withkey".into(),
        capacity: 10,
        timing: FAST,
        database_url: db.url.clone(),
        listen_url: None,
        env: Vec::new(),
        extra: vec![
            "--credentials-key-file".into(),
            key_file.display().to_string(),
        ],
    });
    wait_statuses(
        &mut conn,
        "withkey",
        &[
            (1, "master:"),
            (2, "not encrypted"),
            (3, "do not decrypt"),
            (4, "master:"),
        ],
    )
    .await;
    let (code, status, _) = run_to_end(&["status", "--json"], &[("DATABASE_URL", &db.url)]);
    assert_eq!(code, 0);
    let doc: serde_json::Value = serde_json::from_str(status.trim()).unwrap();
    assert_eq!(doc["errors"], serde_json::json!([2, 3]), "{status}");
    let (_, text, _) = run_to_end(&["status"], &[("DATABASE_URL", &db.url)]);
    assert!(text.contains("in error (see their status): 2, 3"), "{text}");
    with.signal("TERM");
    assert!(with.wait_exit(WAIT).await.success(), "{}", with.output());

    let shown = [without.output(), with.output(), status, text].join("\n");
    for secret in passwords.iter().map(|p| p.to_string()).chain([
        sealed,
        sealed_other,
        key.encode(),
        other.encode(),
    ]) {
        assert!(!shown.contains(&secret), "{secret} shown:\n{shown}");
    }
    broker.stop().await;
}

#[tokio::test]
async fn rotate_brings_every_value_to_the_new_key_and_names_what_it_cannot_read() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let old = CredentialsKey::generate();
    let new = CredentialsKey::generate();
    let stranger = CredentialsKey::generate();
    let values = [
        (1, old.encrypt("pw-a")),
        (2, new.encrypt("pw-b")),
        (3, "pw-c".to_string()),
        (4, stranger.encrypt("pw-d")),
    ];
    for (id, value) in &values {
        add_account(&mut conn, *id, "follower", "127.0.0.1:1", &format!("l{id}")).await;
        set_credentials(&mut conn, *id, value).await;
    }
    let ring = new.clone().then(&old).encode();
    let env = [
        ("DATABASE_URL", db.url.as_str()),
        ("COPIER_CREDENTIALS_KEY", ring.as_str()),
    ];
    let stored = async |conn: &mut PgConnection, id: i64| -> String {
        sqlx::query_scalar("SELECT credentials FROM trading_accounts WHERE id = $1")
            .bind(id)
            .fetch_one(conn)
            .await
            .unwrap()
    };
    let plain = |value: String| {
        copier_node::credentials::decrypt(Some(&new), &Secret::new(value))
            .map(|p| p.expose().to_string())
    };

    let (code, out, err) = run_to_end(&["credentials", "rotate"], &env);
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        out.contains("1 re-encrypted with the current key, 0 plaintext encrypted, 1 already current, 2 left as they were"),
        "{out}"
    );
    assert!(
        err.contains("account 3: the credentials are stored in plaintext"),
        "{err}"
    );
    assert!(
        err.contains("account 4: the credentials do not decrypt"),
        "{err}"
    );
    assert_eq!(plain(stored(&mut conn, 1).await).as_deref(), Ok("pw-a"));
    assert_eq!(
        stored(&mut conn, 2).await,
        values[1].1,
        "a current value is not rewritten"
    );
    assert_eq!(stored(&mut conn, 3).await, "pw-c");
    assert_eq!(stored(&mut conn, 4).await, values[3].1);

    let (code, out2, err2) = run_to_end(&["credentials", "rotate", "--encrypt-plaintext"], &env);
    assert_eq!(code, 1, "{out2}{err2}");
    assert_eq!(plain(stored(&mut conn, 3).await).as_deref(), Ok("pw-c"));
    sqlx::query("UPDATE trading_accounts SET credentials = NULL WHERE id = 4")
        .execute(&mut conn)
        .await
        .unwrap();
    let (code, out3, err3) = run_to_end(&["credentials", "rotate"], &env);
    assert_eq!(code, 0, "{out3}{err3}");
    assert!(
        out3.contains(
            "0 re-encrypted with the current key, 0 plaintext encrypted, 3 already current, 0 left"
        ),
        "{out3}"
    );

    let shown = [out, err, out2, err2, out3, err3].join("\n");
    for secret in ["pw-a", "pw-b", "pw-c", "pw-d", &ring, &stranger.encode()] {
        assert!(!shown.contains(secret), "{secret} shown:\n{shown}");
    }
}

/// The rotation is a library function (the command only prints its report): each value is
/// brought to the current key once, and what it cannot read is named by account.
#[tokio::test]
async fn the_rotation_reports_each_account_it_could_not_bring_to_the_current_key() {
    use copier_node::credentials::rotate;
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let old = CredentialsKey::generate();
    let new = CredentialsKey::generate();
    for (id, value) in [
        (1, old.encrypt("a")),
        (2, new.encrypt("b")),
        (3, "plain".to_string()),
        (4, CredentialsKey::generate().encrypt("d")),
    ] {
        add_account(&mut conn, id, "follower", "127.0.0.1:1", &format!("l{id}")).await;
        set_credentials(&mut conn, id, &value).await;
    }
    let ring = new.clone().then(&old);
    let first = rotate(&mut conn, &ring, false).await.unwrap();
    assert_eq!((first.resealed, first.encrypted, first.current), (1, 0, 1));
    assert_eq!(first.problems.len(), 2, "{:?}", first.problems);
    assert!(
        first.problems[0].starts_with("account 3: ")
            && first.problems[1].starts_with("account 4: ")
    );
    let second = rotate(&mut conn, &ring, true).await.unwrap();
    assert_eq!(
        (second.resealed, second.encrypted, second.current),
        (0, 1, 2),
        "the plaintext value encrypted, the rest already current"
    );
    assert_eq!(
        second.problems.len(),
        1,
        "only the value under a stranger's key is left"
    );
}
