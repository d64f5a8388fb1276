//! Releases over FIX: a venue takes one logon per account (QuickFIX's acceptor drops a second
//! Logon while a session of the account is connected), so a released account is logged out, and
//! the venue has answered its Logout, before the release commits and the next owner logs on.
//! Judged from the venue's journal, which records every Logon (refused ones too) and every
//! Logout a client sent.

use copier_node::sim_broker::journal::JournalEntry;

use super::{
    CopySetup, Positions, WAIT, accepted_orders, hand, owner_of, server, venue, venue_journal,
    wait_status, wait_venue,
};
use crate::support::process::NodeProcess;
use crate::support::{FAST, LinkSpec, add_account, add_link, eventually};

/// For every account, in journal order: no Logon was refused for a session still open, and
/// every accepted Logon comes after the Logout of the node logged on before it. Returns how many
/// times an account passed from one node to another.
fn logged_out_before_each_new_logon(lines: &[JournalEntry], logins: &[&str]) -> usize {
    let mut moves = 0;
    for login in logins {
        // The node logged on now, and the last node that was.
        let mut holder: Option<&str> = None;
        let mut last: Option<&str> = None;
        for l in lines.iter().filter(|l| l.login == *login) {
            match (l.action.as_str(), l.accepted) {
                ("login", false) => panic!("{login}: a Logon refused: {l:?}\n{lines:#?}"),
                ("login", true) => {
                    if let Some(h) = holder {
                        panic!(
                            "{login}: {} logged on while {h} had not logged out: {l:?}\n{lines:#?}",
                            l.client
                        );
                    }
                    moves += usize::from(last.is_some_and(|p| p != l.client));
                    holder = Some(l.client.as_str());
                    last = holder;
                }
                ("logout", _) if holder == Some(l.client.as_str()) => holder = None,
                _ => {}
            }
        }
    }
    moves
}

in_both_position_modes!(released_fix_accounts_are_logged_out_before_their_next_owner_logs_on);
async fn released_fix_accounts_are_logged_out_before_their_next_owner_logs_on(
    positions: Positions,
) {
    let mut s = CopySetup::new("fix-release").await;
    let logins = ["m1", "f1", "f2", "f3"];
    let v = venue(&s, &logins, positions);
    let fix = server(&v, "");
    add_account(&mut s.conn, 1, "master", &fix, "m1").await;
    for id in 2..=4 {
        add_account(&mut s.conn, id, "follower", &fix, logins[id as usize - 1]).await;
        add_link(&mut s.conn, 1, id, LinkSpec::default()).await;
    }
    let copied = async |s: &mut CopySetup, n: usize| {
        for (id, login) in (2..=4).zip(&logins[1..]) {
            wait_status(&mut s.conn, id, "follower: master").await;
            wait_venue(&v, login, &format!("{n} copies"), |p| p.len() == n).await;
        }
    };
    let mut a = NodeProcess::spawn(&s.db, "ra", 100, FAST, &[]);
    hand(&v, "open m1 EURUSD buy 0.1");
    copied(&mut s, 1).await;

    // A second node: fair share moves accounts to it (releases by the first; one or two,
    // as the margin and the cycles' timing have it).
    let _b = NodeProcess::spawn(&s.db, "rb", 100, FAST, &[]);
    eventually("an account moved to the second node", WAIT, async || {
        let mut on_b = 0;
        for id in 1..=4 {
            match owner_of(&mut s.conn, id).await.as_deref() {
                Some("rb") => on_b += 1,
                Some(_) => {}
                None => return None,
            }
        }
        (on_b >= 1).then_some(())
    })
    .await;
    hand(&v, "open m1 EURUSD sell 0.2");
    copied(&mut s, 2).await;

    // SIGTERM of the first node: the second takes its accounts.
    a.signal("TERM");
    a.wait_exit(WAIT).await;
    eventually("every account owned by the second node", WAIT, async || {
        for id in 1..=4 {
            if owner_of(&mut s.conn, id).await.as_deref() != Some("rb") {
                return None;
            }
        }
        Some(())
    })
    .await;
    hand(&v, "open m1 XAUUSD buy 0.3");
    copied(&mut s, 3).await;

    let lines = venue_journal(&v);
    let moves = logged_out_before_each_new_logon(&lines, &logins);
    // Every account ended on the second node: at least one move each (fair share or SIGTERM).
    assert!(moves >= 4, "{moves} moves\n{lines:#?}");
    for login in &logins[1..] {
        let opens = accepted_orders(&lines, login)
            .iter()
            .filter(|l| l.action == "open")
            .count();
        assert_eq!(opens, 3, "{login}: one copy per master trade");
    }
}
