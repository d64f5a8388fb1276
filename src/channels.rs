//! Every NOTIFY channel the nodes use, and the codec of each payload, in one place. The payloads
//! are built in SQL, inside the statement whose result they announce (so nothing is announced
//! that was not committed); this module names each channel, says what its SQL builds, and
//! decodes it for the hub.
//!
//! | channel | sent by | payload |
//! | --- | --- | --- |
//! | [`RELEASED`] | a node's release or departure ([`crate::db::lease`]) | `<platform> <node_id>` |
//! | [`ACCOUNTS`] | triggers on `copy_links` and on `trading_accounts`' connection columns (migrations 5, 6) | the account's id |
//! | [`HANDOFF`] | a node handing an account off for fair share, and the receiver answering ([`crate::handoff`]) | a [`Handoff`] as JSON (an offer, or the receiver's answer; announces, grants nothing) |
//! | [`master`]`(id)` | a master's fenced publish ([`crate::db::copy::publish_many`]: many masters' NOTIFYs may share a commit, one per event) | a [`MasterNotice`] as JSON |

use crate::model::events::MasterNotice;

/// Released accounts or a departed node: peers of the platform claim at once.
pub const RELEASED: &str = "copier_released";

/// An account's links or its connection row changed: its session re-reads them.
pub const ACCOUNTS: &str = "copier_links";

/// Prepared hand-offs: an old owner offers an account to the node it expects to claim it, and
/// that node answers once its login is ready (nothing here grants anything: the release and the
/// claim stay as they are).
pub const HANDOFF: &str = "copier_handoff";

/// A [`HANDOFF`] notice (its payload is this as JSON).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Handoff {
    /// `true`: the receiver's answer; `false`: the old owner's offer.
    pub ready: bool,
    pub account_id: i64,
    /// The old owner.
    pub from: String,
    /// The node expected to claim it.
    pub to: String,
}

impl Handoff {
    pub fn payload(&self) -> String {
        serde_json::to_string(self).expect("hand-off notices serialise")
    }
}

/// The channel of master `master_id`'s events.
pub fn master(master_id: i64) -> String {
    format!("copier_master_{master_id}")
}

/// A decoded notification.
#[derive(Debug, Clone, PartialEq)]
pub enum Notice {
    Released { platform: String, node_id: String },
    AccountChanged(i64),
    Master(MasterNotice),
    Handoff(Handoff),
}

/// The [`RELEASED`] payload the SQL builds (`platform || ' ' || node_id`).
pub fn released_payload(platform: &str, node_id: &str) -> String {
    format!("{platform} {node_id}")
}

/// Decodes a payload received on `channel`; the error says what was wrong with it.
pub fn decode(channel: &str, payload: &str) -> Result<Notice, String> {
    match channel {
        RELEASED => match payload.split_once(' ') {
            Some((platform, node_id)) if !platform.is_empty() && !node_id.is_empty() => {
                Ok(Notice::Released {
                    platform: platform.to_string(),
                    node_id: node_id.to_string(),
                })
            }
            _ => Err(format!("expected `<platform> <node_id>`, got {payload:?}")),
        },
        ACCOUNTS => payload
            .parse()
            .map(Notice::AccountChanged)
            .map_err(|_| format!("expected an account id, got {payload:?}")),
        HANDOFF => serde_json::from_str(payload)
            .map(Notice::Handoff)
            .map_err(|e| format!("not a hand-off notice: {e}")),
        other if other.starts_with("copier_master_") => serde_json::from_str(payload)
            .map(Notice::Master)
            .map_err(|e| format!("not a master notice: {e}")),
        other => Err(format!("no such channel {other:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::events::MasterEvent;

    #[test]
    fn every_payload_round_trips_and_bad_ones_say_why() {
        assert_eq!(
            decode(RELEASED, &released_payload("mt5", "mt5-host-a")),
            Ok(Notice::Released {
                platform: "mt5".into(),
                node_id: "mt5-host-a".into()
            })
        );
        assert_eq!(decode(ACCOUNTS, "42"), Ok(Notice::AccountChanged(42)));
        let notice = MasterNotice {
            master: 7,
            epoch: 3,
            seq: 9,
            event: MasterEvent::Close { ticket: 11 },
        };
        let text = serde_json::to_string(&notice).unwrap();
        assert_eq!(decode(&master(7), &text), Ok(Notice::Master(notice)));
        for (channel, payload) in [
            (RELEASED, "mt5"),
            (ACCOUNTS, "x"),
            ("copier_master_7", "{"),
            ("elsewhere", "1"),
        ] {
            assert!(decode(channel, payload).is_err(), "{channel} {payload}");
        }
        let offer = Handoff {
            ready: false,
            account_id: 5,
            from: "node a".into(),
            to: "b".into(),
        };
        assert_eq!(
            decode(HANDOFF, &offer.payload()),
            Ok(Notice::Handoff(offer))
        );
        assert!(decode(HANDOFF, "offer 5 a b").is_err());
        assert_eq!(master(12), "copier_master_12");
    }
}
