//! The follower's links: read them (a row that does not parse is reported with its id and
//! ignored), subscribe to each master's events before any snapshot of it is read, and reconcile
//! the masters whose links changed.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use tracing::{info, warn};

use super::Follower;
use crate::db;
use crate::hub::Topic;

impl Follower<'_> {
    /// Re-reads the links; subscribes to new masters (before any snapshot of theirs is read) and
    /// reconciles masters whose links changed. False if the task was stopped meanwhile.
    pub(super) async fn reload_links(&mut self) -> bool {
        self.load_links(true).await
    }

    /// As [`Self::reload_links`], leaving the reconciles to the caller (who reconciles every
    /// master anyway).
    pub(super) async fn reload_links_only(&mut self) -> bool {
        self.load_links(false).await
    }

    async fn load_links(&mut self, reconcile_changed: bool) -> bool {
        let loaded = async {
            let mut conn = self.ctx.node.pool.acquire().await?;
            let rows = db::copy::load_links(&mut conn, self.id).await?;
            let max = db::copy::follower_max_open_copies(&mut conn, self.id).await?;
            Ok::<_, sqlx::Error>((rows, max))
        }
        .await;
        let rows = match loaded {
            Ok((rows, max)) => {
                self.max_open_copies = max;
                rows
            }
            Err(e) => {
                warn!(error = %db::describe(&e), "reading the follower's links failed; keeping the current ones");
                return true;
            }
        };
        let mut links = Vec::new();
        let mut problems = BTreeSet::new();
        for row in rows {
            match row {
                Ok(link) => links.push(link),
                Err(problem) => {
                    if !self.bad_links.contains(&problem) {
                        warn!(problem = %problem, "ignoring a copy link that does not parse");
                    }
                    problems.insert(problem);
                }
            }
        }
        if problems != self.bad_links {
            self.bad_links = problems;
            let status = self.status.clone();
            self.set_status(&status);
        }
        if self.links_loaded && links == self.links {
            return true;
        }
        let wanted: HashSet<i64> = links.iter().map(|l| l.master_id).collect();
        for m in &wanted {
            if !self.subscriptions.contains_key(m) {
                let sub = tokio::select! {
                    _ = self.ctx.cancel.cancelled() => return false,
                    s = self.ctx.node.hub.subscribe(Topic::Master(*m), self.signals.clone()) => s,
                };
                match sub {
                    Some(s) => {
                        self.subscriptions.insert(*m, s);
                    }
                    None => return false,
                }
            }
        }
        self.subscriptions.retain(|m, _| wanted.contains(m));
        let changed: BTreeMap<i64, ()> = links
            .iter()
            .filter(|l| !self.links.contains(l))
            .map(|l| (l.master_id, ()))
            .chain(
                self.links
                    .iter()
                    .filter(|l| !links.contains(l))
                    .map(|l| (l.master_id, ())),
            )
            .collect();
        let first = !self.links_loaded;
        self.links_loaded = true;
        if !first {
            info!(links = links.len(), "copy links changed");
        }
        self.links = links;
        self.masters.retain(|m, _| wanted.contains(m));
        if self.links.is_empty() {
            self.set_status("follower: no copy links");
        }
        if !first {
            for m in changed.keys().filter(|m| wanted.contains(m)) {
                self.masters.remove(m);
                if reconcile_changed {
                    self.reconcile_master(*m, "copy link changed").await;
                }
            }
        }
        true
    }
}
