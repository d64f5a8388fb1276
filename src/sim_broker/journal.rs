//! The journal: one JSON object per order request (and login), every key always present, numbers
//! as numbers, appended and flushed before the reply is sent (docs/design/bridge-protocol.md). It is the
//! impartial witness the tests check every node's behaviour against.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::broker::types::{Position, Side};

/// One journal line. `accepted` says whether the request was executed: a repeated client order
/// id that returned an earlier result is journaled as not accepted, with the reason.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JournalEntry {
    pub ts_ms: i64,
    /// The same instant in microseconds, on the same clock (for instruments that time
    /// sub-millisecond legs from the journal alone); `null` in journals written before it.
    #[serde(default)]
    pub ts_us: Option<i64>,
    pub login: String,
    pub client: String,
    /// `open`, `close`, `modify`, `login`, or for pending orders `place`, `amend`, `cancel`.
    pub action: String,
    pub ticket: Option<i64>,
    pub symbol: Option<String>,
    pub side: Option<Side>,
    pub volume: Option<f64>,
    pub magic: Option<i64>,
    pub comment: Option<String>,
    pub fence: Option<i64>,
    /// The request's client order id (`null` when none).
    pub client_order_id: Option<String>,
    pub accepted: bool,
    pub reason: Option<String>,
}

/// Reads a whole journal: the one reader the demo, the tests and the fault suite's checker share.
/// A missing file is an empty journal; a line that does not parse is an error naming it. The
/// journal may be read while the broker writes it: a last line without its newline is not
/// written yet, and is left out.
pub fn read(path: &std::path::Path) -> anyhow::Result<Vec<JournalEntry>> {
    let mut bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(anyhow::anyhow!("reading journal {}: {e}", path.display())),
    };
    let complete = bytes.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
    bytes.truncate(complete);
    let text = String::from_utf8(bytes)
        .map_err(|e| anyhow::anyhow!("journal {} is not UTF-8: {e}", path.display()))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l)
                .map_err(|e| anyhow::anyhow!("journal {} line {}: {e}: {l}", path.display(), i + 1))
        })
        .collect()
}

impl JournalEntry {
    pub fn new(ts_ms: i64, login: &str, client: &str, action: &str) -> Self {
        JournalEntry {
            ts_ms,
            ts_us: None,
            login: login.to_string(),
            client: client.to_string(),
            action: action.to_string(),
            ticket: None,
            symbol: None,
            side: None,
            volume: None,
            magic: None,
            comment: None,
            fence: None,
            client_order_id: None,
            accepted: false,
            reason: None,
        }
    }

    /// Fills symbol, side, magic and comment from the position a request acts on.
    pub fn describe(&mut self, p: &Position) {
        self.symbol = Some(p.symbol.clone());
        self.side = Some(p.side);
        self.magic = Some(p.magic);
        self.comment = Some(p.comment.clone());
    }

    pub fn finish<T>(&mut self, result: &Result<T, String>) {
        self.finish_dup(result, |_| false);
    }

    /// As [`JournalEntry::finish`]; a result that `is_duplicate` was not executed again.
    pub fn finish_dup<T>(&mut self, result: &Result<T, String>, is_duplicate: impl Fn(&T) -> bool) {
        match result {
            Ok(t) if is_duplicate(t) => {
                self.accepted = false;
                self.reason = Some(
                    "duplicate client_order_id: already executed; the original result was returned"
                        .into(),
                );
            }
            Ok(_) => {
                self.accepted = true;
                self.reason = None;
            }
            Err(reason) => {
                self.accepted = false;
                self.reason = Some(reason.clone());
            }
        }
    }
}

/// The journal file, appended to.
#[derive(Debug)]
pub struct Journal {
    out: BufWriter<File>,
}

impl Journal {
    pub fn open(path: &Path) -> std::io::Result<Self> {
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        Ok(Journal {
            out: BufWriter::new(file),
        })
    }

    /// Appends one line and flushes it to the operating system.
    pub fn append(&mut self, entry: &JournalEntry) -> std::io::Result<()> {
        serde_json::to_writer(&mut self.out, entry)?;
        self.out.write_all(b"\n")?;
        self.out.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_being_written_is_not_read_yet() {
        let dir = std::env::temp_dir().join(format!("journal-partial-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("journal.jsonl");
        let line = serde_json::to_string(&JournalEntry::new(1, "f1", "n", "open")).unwrap();
        std::fs::write(&path, format!("{line}\n{}", &line[..line.len() / 2])).unwrap();
        assert_eq!(read(&path).unwrap().len(), 1, "the complete line only");
        std::fs::write(&path, format!("{line}\n{line}\n")).unwrap();
        assert_eq!(read(&path).unwrap().len(), 2);
        std::fs::write(&path, format!("{line}\nnot json\n")).unwrap();
        assert!(read(&path).is_err(), "a complete bad line is an error");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn every_key_is_always_present() {
        let e = JournalEntry::new(1, "1001", "manual", "login");
        let v: serde_json::Value = serde_json::to_value(&e).unwrap();
        let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        for k in [
            "ts_ms", "ts_us", "login", "client", "action", "ticket", "symbol", "side", "volume",
            "magic", "comment", "fence", "accepted", "reason",
        ] {
            assert!(keys.contains(&k), "{k}");
        }
        assert!(v["ticket"].is_null() && v["accepted"] == false);
    }
}
