//! The FIX 4.4 test venue (`tests/fix/acceptor.cpp`, on QuickFIX C++): built once per source
//! version with g++ against Debian's `libquickfix-dev`, started per test with its sessions, and
//! a plain FIX client to drive it.
//!
//! The client frames tag=value messages, nothing more: it is the tests' hand on the venue (the
//! session layer under test is QuickFIX's, on the venue's side).

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[path = "../../fix/venue.rs"]
mod venue;
pub use venue::{FixVenue, VenueAccount};

pub const SOH: char = '\u{1}';

/// A message as tag -> value pairs, in order: the adapter's own reading of FIX text.
pub use copier_node::broker::fix::msg::Fields as Msg;

/// A plain FIX 4.4 initiator connection: frames and sequence numbers, nothing else.
pub struct FixClient {
    stream: TcpStream,
    buf: Vec<u8>,
    sender: String,
    target: String,
    pub seq: u64,
}

impl FixClient {
    pub async fn connect(port: u16, sender: &str, target: &str) -> FixClient {
        FixClient {
            stream: TcpStream::connect(("127.0.0.1", port)).await.unwrap(),
            buf: Vec::new(),
            sender: sender.into(),
            target: target.into(),
            seq: 1,
        }
    }

    /// Sends a message of `msg_type` with header fields (SenderSubID and the like) and body.
    pub async fn send(&mut self, msg_type: &str, header: &[(u32, &str)], body: &[(u32, &str)]) {
        let mut fields = format!(
            "35={msg_type}{SOH}49={}{SOH}56={}{SOH}34={}{SOH}52={}{SOH}",
            self.sender,
            self.target,
            self.seq,
            sending_time()
        );
        for (t, v) in header.iter().chain(body) {
            fields.push_str(&format!("{t}={v}{SOH}"));
        }
        let head = format!("8=FIX.4.4{SOH}9={}{SOH}", fields.len());
        let mut msg = head + &fields;
        let sum: u32 = msg.bytes().map(u32::from).sum::<u32>() % 256;
        msg.push_str(&format!("10={sum:03}{SOH}"));
        self.stream.write_all(msg.as_bytes()).await.unwrap();
        self.seq += 1;
    }

    /// Logs on (HeartBtInt 30, ResetSeqNumFlag as given) with 553/554 and SenderSubID.
    pub async fn logon(&mut self, user: &str, password: &str, sub_id: &str, reset: bool) {
        let reset = if reset { "Y" } else { "N" };
        self.send(
            "A",
            &[(50, sub_id)],
            &[
                (98, "0"),
                (108, "30"),
                (141, reset),
                (553, user),
                (554, password),
            ],
        )
        .await;
    }

    /// The next message, or `None` when the venue closed the connection (or after `within`).
    pub async fn recv(&mut self, within: Duration) -> Option<Msg> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if let Some(m) = self.take_frame() {
                return Some(m);
            }
            let mut chunk = [0u8; 4096];
            let n = tokio::time::timeout_at(deadline, self.stream.read(&mut chunk))
                .await
                .ok()?
                .ok()?;
            if n == 0 {
                return None;
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }

    /// True once the venue closed the connection within `within` (messages before are skipped);
    /// false if it was still open then.
    pub async fn closed(&mut self, within: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let mut chunk = [0u8; 4096];
            match tokio::time::timeout_at(deadline, self.stream.read(&mut chunk)).await {
                Err(_) => return false,
                Ok(Ok(0)) | Ok(Err(_)) => return true,
                Ok(Ok(_)) => continue,
            }
        }
    }

    /// The next message of `msg_type`, skipping heartbeats and others; panics after `within`.
    pub async fn expect(&mut self, msg_type: &str, within: Duration) -> Msg {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match self.recv(left).await {
                Some(m) if m.msg_type() == msg_type => return m,
                Some(_) => continue,
                None => panic!("no {msg_type} message within {within:?}"),
            }
        }
    }

    fn take_frame(&mut self) -> Option<Msg> {
        let text = String::from_utf8_lossy(&self.buf).to_string();
        let end = text.find(&format!("{SOH}10="))?;
        let close = text[end + 1..].find(SOH)? + end + 1;
        let frame = text[..close].to_string();
        self.buf.drain(..=close);
        Some(Msg::parse(&frame))
    }
}

/// FIX's SendingTime (52) is wall-clock time by definition.
#[allow(clippy::disallowed_methods)]
fn sending_time() -> String {
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    copier_node::broker::fix::msg::utc_timestamp(ms)
}
