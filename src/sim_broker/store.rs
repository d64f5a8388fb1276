//! `--state PATH`: the server's accounts, positions, pending orders, history, fences, executed
//! client order ids and its next ticket survive a restart. Every change is appended to the file as a [`Record`] line and flushed
//! before the reply is sent; at start the file is replayed, then rewritten compactly.

use std::fs::{self, File, OpenOptions};
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::Context;

use super::book::{Book, Record};

/// The open state file.
#[derive(Debug)]
pub struct Store {
    path: PathBuf,
    out: BufWriter<File>,
}

impl Store {
    /// Replays `path` (if it exists) into `book`, compacts it, and opens it for appending.
    pub fn open(path: &Path, book: &mut Book) -> anyhow::Result<Self> {
        if path.exists() {
            let file = File::open(path)
                .with_context(|| format!("opening state file {}", path.display()))?;
            for (n, line) in BufReader::new(file).lines().enumerate() {
                let line =
                    line.with_context(|| format!("reading state file {}", path.display()))?;
                if line.trim().is_empty() {
                    continue;
                }
                match serde_json::from_str::<Record>(&line) {
                    Ok(record) => book.apply(&record),
                    // A torn last line (killed mid-write) is dropped; anything else is corrupt.
                    Err(_) if is_last_line(path, n)? => break,
                    Err(e) => anyhow::bail!("state file {} line {}: {e}", path.display(), n + 1),
                }
            }
        }
        let tmp = path.with_extension("compacting");
        {
            let mut w = BufWriter::new(
                File::create(&tmp).with_context(|| format!("writing {}", tmp.display()))?,
            );
            for record in book.snapshot() {
                serde_json::to_writer(&mut w, &record)?;
                w.write_all(b"\n")?;
            }
            w.flush()?;
            w.get_ref().sync_all()?;
        }
        fs::rename(&tmp, path).with_context(|| format!("replacing {}", path.display()))?;
        let out = BufWriter::new(OpenOptions::new().append(true).open(path)?);
        Ok(Store {
            path: path.to_path_buf(),
            out,
        })
    }

    /// Appends records and flushes them.
    pub fn append(&mut self, records: &[Record]) -> std::io::Result<()> {
        if records.is_empty() {
            return Ok(());
        }
        for r in records {
            serde_json::to_writer(&mut self.out, r)?;
            self.out.write_all(b"\n")?;
        }
        self.out.flush()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

fn is_last_line(path: &Path, n: usize) -> anyhow::Result<bool> {
    let total = BufReader::new(File::open(path)?).lines().count();
    Ok(n + 1 == total)
}
