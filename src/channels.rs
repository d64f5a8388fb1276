//! Every NOTIFY channel the nodes use, and the codec of each payload, in one place. The payloads
//! are built in SQL, inside the statement whose result they announce (so nothing is announced
//! that was not committed); this module names each channel, says what its SQL builds, and
//! decodes it for the hub.
//!
//! | channel | sent by | payload |
//! | --- | --- | --- |
//! | [`RELEASED`] | a node's release or departure ([`crate::db::lease`]) | `<platform> ` and a [`Release`] as JSON (who released, and the receiver a hand-off named; older nodes sent `<platform> <node_id>`) |
//! | [`ACCOUNTS`] | triggers on `copy_links` and on `trading_accounts`' connection columns (migrations 5, 6) | the account's id |
//! | [`HANDOFF`] | a node handing an account off for fair share, and the receiver answering ([`crate::handoff`]) | a [`Handoff`] as JSON (an offer, or the receiver's answer; announces, grants nothing) |
//! | [`master`]`(id)` | a master's fenced publish ([`crate::db::copy::publish_many`]: many masters' NOTIFYs may share a commit, one per event) | a [`MasterNotice`] as JSON |

use crate::model::events::MasterNotice;

/// Released accounts or a departed node: the hand-off's receiver and the peers below their
/// shares claim at once, and a departure wakes every peer of the platform ([`Release::wakes`]).
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
    /// In an answer: `Some(true)`, the receiver has room and is not shutting down, so it will
    /// claim the account once released (the release then names it: [`Release::wakes`]);
    /// `Some(false)`, it has no room (a fair-share move is then called off). Older nodes'
    /// answers lack it (`None`): the hand-off goes on and its release names nobody. `None` in
    /// an offer.
    #[serde(default)]
    pub claims: Option<bool>,
    /// In an offer: the old owner is shutting down and chose the receiver by the shares without
    /// itself, so the receiver takes it while it has room below its capacity, at its own share
    /// or not ([`Room::takes`]). Absent (older nodes): `false`.
    #[serde(default)]
    pub leaving: bool,
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

/// A [`RELEASED`] announcement, after its platform.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Release {
    /// The node that released (or left).
    pub from: String,
    /// The node a hand-off named to take the accounts (it answered that it will claim them);
    /// `None`: anyone with room may (a shutdown's hand-off whose receiver did not say it would
    /// claim, an account disabled elsewhere).
    pub to: Option<String>,
    /// `from` leaves the fair shares (it is shutting down, or has left): every peer's share
    /// grows, which its next cycle learns. Absent in older nodes' announcements.
    #[serde(default)]
    pub leaving: bool,
    /// A leave whose departure `from` announced before (as its shutdown began): every peer
    /// counts its share without `from` already, so it wakes the nodes with room (what `from`
    /// released while it drained may be free still), not every peer a second time. Absent in
    /// older nodes' announcements (and in the departure's own): every peer wakes.
    #[serde(default)]
    pub announced: bool,
    /// How many claimable accounts the statement released (one announcement stands for a
    /// batch's releases to the same receiver). Absent in older nodes' announcements: one.
    #[serde(default = "one")]
    pub accounts: u32,
}

fn one() -> u32 {
    1
}

/// Nodes woken beyond the released accounts by a release that names no receiver (in
/// expectation, [`Room::odds`]): in case a woken node has filled up since its view, or its
/// notification comes late.
pub const SPARE_WAKES: f64 = 4.0;

/// A node's room for accounts, as its last cycle saw the platform: what decides which releases
/// wake it ([`Release::wakes`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Room {
    /// How many accounts the node lacks to its fair share (within its capacity): 0, no room
    /// (or shutting down, running late, still counting its share at a cold start).
    pub lacks: u32,
    /// How many of its trusted peers are below their shares, by their published counts.
    pub peers_below: u32,
    /// Able to claim at its next cycle and below its capacity, at its share or not: it takes
    /// what a departing peer offers it ([`Handoff::leaving`]), since that peer's share is
    /// split among the nodes that stay.
    pub takes_over: bool,
}

impl Room {
    /// Below its share: it answers a fair-share move's offers that it will claim (a departing
    /// peer's by [`Room::takes_over`]), and releases naming no one may wake it.
    pub fn any(&self) -> bool {
        self.lacks > 0
    }

    /// Whether it answers an offer that it will claim the account: below its share, or, for a
    /// departing peer's offer (`leaving`), below its capacity. A promise of room only: a
    /// receiver whose next cycle still counts the departing peer (its departure not yet read)
    /// claims at the cycle after, and one offered more than it can start claims the rest as
    /// its sessions start (the old owner's check announces what stays free a second on).
    pub fn takes(&self, leaving: bool) -> bool {
        if leaving { self.takes_over } else { self.any() }
    }

    /// The chance that a release of `accounts` accounts that names no receiver wakes this node:
    /// the accounts and [`SPARE_WAKES`] more spread over the nodes below their shares, so that
    /// about that many of them wake, however many there are. (Weighing by what each lacks
    /// woke too few: a peer far below its share in the published counts, just joined or still
    /// counting its share, took most of the odds and was often not yet claiming.)
    pub fn odds(&self, accounts: u32) -> f64 {
        if !self.any() {
            return 0.0;
        }
        ((f64::from(accounts) + SPARE_WAKES) / (1.0 + f64::from(self.peers_below))).min(1.0)
    }
}

impl Release {
    /// Whether node `me` of `platform`, with `room`, claims at once on this announcement heard
    /// on `from_platform` (a peer's, of its platform), `draw` a uniform draw in [0, 1): the
    /// node a hand-off named (it answered that it has room); for a release that names nobody,
    /// about as many of the nodes with room as there are accounts, and [`SPARE_WAKES`] more
    /// ([`Room::odds`]); and every peer when `from` leaves (the shares change), unless that
    /// departure was announced before (`announced`: then every node with room, since the
    /// accounts `from` released while it drained may be free still: released before the peers
    /// counted their shares without it, they woke the few nodes with room then, and one of
    /// those may not have claimed, its cycle failing or late; the simulator's one-node tail).
    /// Every other
    /// node keeps its cycle: a node at its share could claim nothing (its claim is bounded by
    /// its share), and a release named to another node is that node's (still free a second
    /// later, it is announced again naming no one). An account nobody woke for is claimed at the
    /// next cycle of a node with room (a period at most).
    pub fn wakes(
        &self,
        from_platform: &str,
        platform: &str,
        me: &str,
        room: Room,
        draw: f64,
    ) -> bool {
        if from_platform != platform || self.from == me {
            return false;
        }
        match self.to.as_deref() {
            _ if self.leaving && !self.announced => true,
            _ if self.leaving => room.any(),
            Some(to) => to == me,
            None => draw < room.odds(self.accounts),
        }
    }
}

/// A decoded notification.
#[derive(Debug, Clone, PartialEq)]
pub enum Notice {
    Released { platform: String, release: Release },
    AccountChanged(i64),
    Master(MasterNotice),
    Handoff(Handoff),
}

/// The [`RELEASED`] payload the SQL builds (`platform || ' ' || json_build_object(...)`).
pub fn released_payload(platform: &str, release: &Release) -> String {
    format!(
        "{platform} {}",
        serde_json::to_string(release).expect("releases serialise")
    )
}

/// Decodes a payload received on `channel`; the error says what was wrong with it.
pub fn decode(channel: &str, payload: &str) -> Result<Notice, String> {
    match channel {
        RELEASED => match payload.split_once(' ') {
            Some((platform, rest)) if !platform.is_empty() && !rest.is_empty() => {
                // An older node's announcement names only itself: every peer wakes, as it did.
                let release = serde_json::from_str(rest).unwrap_or_else(|_| Release {
                    from: rest.to_string(),
                    to: None,
                    leaving: true,
                    announced: false,
                    accounts: 1,
                });
                Ok(Notice::Released {
                    platform: platform.to_string(),
                    release,
                })
            }
            _ => Err(format!(
                "expected `<platform> <release as JSON>`, got {payload:?}"
            )),
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
        let named = Release {
            from: "mt5 host a".into(),
            to: Some("mt5-host-b".into()),
            leaving: false,
            announced: false,
            accounts: 4,
        };
        assert_eq!(
            decode(RELEASED, &released_payload("mt5", &named)),
            Ok(Notice::Released {
                platform: "mt5".into(),
                release: named
            })
        );
        // What an older node sends: its node id alone.
        assert_eq!(
            decode(RELEASED, "mt5 mt5-host-a"),
            Ok(Notice::Released {
                platform: "mt5".into(),
                release: Release {
                    from: "mt5-host-a".into(),
                    to: None,
                    leaving: true,
                    announced: false,
                    accounts: 1,
                }
            })
        );
        // An announcement of the named-receivers release: not leaving, one account.
        assert_eq!(
            decode(RELEASED, r#"mt5 {"from":"a","to":null}"#),
            Ok(Notice::Released {
                platform: "mt5".into(),
                release: Release {
                    from: "a".into(),
                    to: None,
                    leaving: false,
                    announced: false,
                    accounts: 1,
                }
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
            claims: None,
            leaving: false,
        };
        assert_eq!(
            decode(HANDOFF, &offer.payload()),
            Ok(Notice::Handoff(offer.clone()))
        );
        let leaving = Handoff {
            leaving: true,
            ..offer.clone()
        };
        assert_eq!(
            decode(HANDOFF, &leaving.payload()),
            Ok(Notice::Handoff(leaving))
        );
        assert!(decode(HANDOFF, "offer 5 a b").is_err());
        // An older node's answer: it says nothing of claiming.
        assert_eq!(
            decode(
                HANDOFF,
                r#"{"ready":true,"account_id":5,"from":"node a","to":"b"}"#
            ),
            Ok(Notice::Handoff(Handoff {
                ready: true,
                ..offer
            }))
        );
        assert_eq!(master(12), "copier_master_12");
    }

    #[test]
    fn a_release_wakes_its_named_receiver_a_bounded_few_with_room_and_a_departure_every_peer_or_every_one_with_room()
     {
        let release = |to: Option<&str>, leaving: bool, accounts: u32| Release {
            from: "a".into(),
            to: to.map(str::to_string),
            leaving,
            announced: false,
            accounts,
        };
        let none = Room::default();
        let room = |peers_below: u32| Room {
            lacks: 3,
            peers_below,
            takes_over: true,
        };
        let named = release(Some("b"), false, 1);
        assert!(
            named.wakes("mt5", "mt5", "b", none, 0.0),
            "the named receiver"
        );
        assert!(
            !named.wakes("mt5", "mt5", "c", room(0), 0.0),
            "a peer with room keeps its cycle: the account is the receiver's"
        );
        assert!(
            !named.wakes("mt4", "mt5", "b", room(0), 0.0),
            "another platform's release"
        );
        let unnamed = release(None, false, 1);
        assert!(
            !unnamed.wakes("mt5", "mt5", "c", none, 0.0),
            "a peer at its share keeps its cycle"
        );
        assert!(
            unnamed.wakes("mt5", "mt5", "c", room(0), 0.999),
            "the only node with room, whatever its draw"
        );
        // Among 99 peers below their shares, one account wakes one in 100/(1+SPARE_WAKES).
        let odds = room(99).odds(1);
        assert_eq!(odds, (1.0 + SPARE_WAKES) / 100.0);
        assert!(unnamed.wakes("mt5", "mt5", "c", room(99), odds * 0.99));
        assert!(!unnamed.wakes("mt5", "mt5", "c", room(99), odds));
        // Over every node with room, about the accounts and the spares wake, however many.
        for below in [0u32, 9, 99, 999, 99_999] {
            for accounts in [1u32, 7, 500] {
                let woken = f64::from(below + 1) * room(below).odds(accounts);
                let expected = (f64::from(accounts) + SPARE_WAKES).min(f64::from(below + 1));
                assert!(
                    (woken - expected).abs() < 1e-9,
                    "{accounts} accounts, {below} peers below: {woken} woken"
                );
            }
        }
        let departure = release(None, true, 0);
        assert!(
            departure.wakes("mt5", "mt5", "c", none, 0.999),
            "every peer"
        );
        assert!(
            !departure.wakes("mt5", "mt5", "a", room(0), 0.0),
            "its own release"
        );
        // The leave after an announced departure: the peers already count without `a`, and
        // every one with room wakes, whatever its draw (the accounts `a` released while it
        // drained may still be free); a peer at its share keeps its cycle.
        let leave = Release {
            announced: true,
            ..release(None, true, 0)
        };
        assert!(
            !leave.wakes("mt5", "mt5", "c", none, 0.0),
            "a peer at its share keeps its cycle"
        );
        assert!(leave.wakes("mt5", "mt5", "c", room(99), 0.999));
        assert!(
            !leave.wakes("mt5", "mt5", "a", room(99), 0.0),
            "its own leave"
        );
        // A leave whose departure was not announced (the announcement failed): every peer.
        assert!(release(None, true, 7).wakes("mt5", "mt5", "c", none, 0.999));
    }
}
