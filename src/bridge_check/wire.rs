//! A bare client of the bridge protocol: JSON lines as they come off the wire. The kit does not
//! use the node's own client (`broker::client`), which forgives what a bridge may get wrong
//! (out-of-order replies, missing codes, late events): what is checked is what the bridge sent.

use std::time::Duration;

use serde_json::{Map, Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::time::Instant;

/// What a bridge answered to a request.
#[derive(Debug, Clone)]
pub(crate) enum Answer {
    /// `ok: true`: the result object.
    Done(Value),
    /// `ok: false`: the error's `kind`, `code` (if any) and `reason`.
    Refused {
        kind: String,
        code: Option<String>,
        reason: String,
    },
}

impl Answer {
    /// The result, or why there is none, naming the request.
    pub(crate) fn done(self, what: &str) -> Result<Value, String> {
        match self {
            Answer::Done(v) => Ok(v),
            Answer::Refused { kind, code, reason } => Err(format!(
                "{what} was refused ({kind}, code {}): {reason}",
                code.as_deref().unwrap_or("none")
            )),
        }
    }
}

/// One frame received, in arrival order.
#[derive(Debug, Clone)]
pub(crate) enum Frame {
    /// A pushed event (no `id`).
    Event(Value),
    /// A reply.
    Reply,
}

/// One connection to a bridge.
pub(crate) struct Wire {
    lines: Lines<BufReader<OwnedReadHalf>>,
    writer: OwnedWriteHalf,
    next_id: u64,
    timeout: Duration,
    /// Every frame received so far, in arrival order (the events checks read it).
    pub(crate) frames: Vec<Frame>,
}

impl Wire {
    /// Connects to `addr` (host:port); `timeout` bounds each wait for a reply.
    pub(crate) async fn connect(addr: &str, timeout: Duration) -> Result<Wire, String> {
        let stream = tokio::time::timeout(timeout, TcpStream::connect(addr))
            .await
            .map_err(|_| format!("no connection to {addr} within {timeout:?}"))?
            .map_err(|e| format!("cannot connect to {addr}: {e}"))?;
        let _ = stream.set_nodelay(true);
        let (read, writer) = stream.into_split();
        Ok(Wire {
            lines: BufReader::new(read).lines(),
            writer,
            next_id: 1,
            timeout,
            frames: Vec::new(),
        })
    }

    /// Sends `{"id", "op", ...fields}` and returns the id, without waiting for the reply.
    pub(crate) async fn send(&mut self, op: &str, fields: Value) -> Result<u64, String> {
        let id = self.next_id;
        self.next_id += 1;
        let mut frame = Map::new();
        frame.insert("id".into(), json!(id));
        frame.insert("op".into(), json!(op));
        if let Value::Object(fields) = fields {
            frame.extend(fields);
        }
        let mut line = Value::Object(frame).to_string();
        line.push('\n');
        self.writer
            .write_all(line.as_bytes())
            .await
            .map_err(|e| format!("sending {op}: {e}"))?;
        Ok(id)
    }

    /// Sends a request and waits for its reply (events that arrive meanwhile are kept).
    pub(crate) async fn request(&mut self, op: &str, fields: Value) -> Result<Answer, String> {
        let id = self.send(op, fields).await?;
        let deadline = Instant::now() + self.timeout;
        loop {
            let Some(frame) = self.read_until(deadline).await? else {
                return Err(format!("no reply to {op} within {:?}", self.timeout));
            };
            if frame.get("id").and_then(Value::as_u64) != Some(id) {
                continue;
            }
            return parse_answer(op, &frame);
        }
    }

    /// Waits until an event received on this connection satisfies `wanted` (looking first at
    /// those already received), for at most the timeout; returns its position in
    /// [`Wire::frames`].
    pub(crate) async fn wait_event(
        &mut self,
        wanted: impl Fn(&Value) -> bool,
    ) -> Result<Option<usize>, String> {
        let found = |frames: &[Frame]| {
            frames
                .iter()
                .position(|f| matches!(f, Frame::Event(e) if wanted(e)))
        };
        if let Some(at) = found(&self.frames) {
            return Ok(Some(at));
        }
        let deadline = Instant::now() + self.timeout;
        while self.read_until(deadline).await?.is_some() {
            if let Some(at) = found(&self.frames) {
                return Ok(Some(at));
            }
        }
        Ok(None)
    }

    /// Reads one frame, recording it; `None` at the deadline.
    async fn read_until(&mut self, deadline: Instant) -> Result<Option<Value>, String> {
        let line = match tokio::time::timeout_at(deadline, self.lines.next_line()).await {
            Err(_) => return Ok(None),
            Ok(Err(e)) => return Err(format!("reading from the bridge: {e}")),
            Ok(Ok(None)) => return Err("the bridge closed the connection".to_string()),
            Ok(Ok(Some(line))) => line,
        };
        let frame: Value = serde_json::from_str(&line)
            .map_err(|e| format!("a line that is not JSON ({e}): {line}"))?;
        if frame.get("event").is_some() {
            self.frames.push(Frame::Event(frame.clone()));
        } else if frame.get("id").and_then(Value::as_u64).is_some() {
            self.frames.push(Frame::Reply);
        } else {
            return Err(format!(
                "a line that is neither a reply nor an event: {line}"
            ));
        }
        Ok(Some(frame))
    }
}

fn parse_answer(op: &str, frame: &Value) -> Result<Answer, String> {
    match frame.get("ok").and_then(Value::as_bool) {
        Some(true) => Ok(Answer::Done(
            frame.get("result").cloned().unwrap_or(Value::Null),
        )),
        Some(false) => {
            let error = frame.get("error").cloned().unwrap_or(Value::Null);
            let text = |key: &str| error.get(key).and_then(Value::as_str).map(str::to_string);
            Ok(Answer::Refused {
                kind: text("kind").unwrap_or_default(),
                code: text("code"),
                reason: text("reason").unwrap_or_default(),
            })
        }
        None => Err(format!("the reply to {op} has no boolean `ok`: {frame}")),
    }
}
