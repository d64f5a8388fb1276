//! A chaos TCP proxy between a node and PostgreSQL. It forwards bytes until told to hang (stop
//! forwarding in both directions, or only the server's replies, keeping every socket open, as a
//! dead network path or a frozen peer does), can cut every open connection, and can be pointed
//! at another server (a promoted standby: what a virtual IP or HAProxy does on failover).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// What the proxy does with bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Forward,
    /// Nothing passes in either direction; sockets stay open.
    Hang,
    /// Requests reach the server; its replies do not come back.
    HangReplies,
}

pub struct ChaosProxy {
    pub port: u16,
    mode: watch::Sender<Mode>,
    generation: Arc<AtomicU64>,
    target: Arc<Mutex<String>>,
    accept: JoinHandle<()>,
}

impl ChaosProxy {
    /// Starts a proxy on a free loopback port in front of `target` (`host:port`).
    pub async fn start(target: String) -> ChaosProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (mode, rx) = watch::channel(Mode::Forward);
        let generation = Arc::new(AtomicU64::new(0));
        let gen_accept = generation.clone();
        let target = Arc::new(Mutex::new(target));
        let target_accept = target.clone();
        let accept = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                let rx = rx.clone();
                let generation = gen_accept.clone();
                let target = target_accept.lock().unwrap().clone();
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(target.as_str()).await else {
                        return;
                    };
                    let born = generation.load(Ordering::SeqCst);
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    let up = pump(cr, sw, rx.clone(), false, generation.clone(), born);
                    let down = pump(sr, cw, rx, true, generation, born);
                    tokio::select! { _ = up => {}, _ = down => {} }
                });
            }
        });
        ChaosProxy {
            port,
            mode,
            generation,
            target,
            accept,
        }
    }

    pub fn set(&self, mode: Mode) {
        self.mode.send_replace(mode);
    }

    /// Sends new connections to `target` from now on, and cuts the open ones.
    pub fn retarget(&self, target: String) {
        *self.target.lock().unwrap() = target;
        self.cut();
    }

    /// Closes every connection open now (new ones are accepted as usual).
    pub fn cut(&self) {
        self.generation.fetch_add(1, Ordering::SeqCst);
        // Wake the pumps so they notice.
        self.mode.send_modify(|_| {});
    }
}

impl Drop for ChaosProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut mode: watch::Receiver<Mode>,
    is_reply: bool,
    generation: Arc<AtomicU64>,
    born: u64,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        // Wait while this direction is hung (bytes stay unread in the kernel's buffers).
        if !wait_open(&mut mode, is_reply, &generation, born).await {
            return;
        }
        let n = tokio::select! {
            r = from.read(&mut buf) => match r { Ok(0) | Err(_) => return, Ok(n) => n },
            _ = mode.changed() => continue,
        };
        // Read while forwarding, then the mode changed: hold the bytes until forwarding again.
        if !wait_open(&mut mode, is_reply, &generation, born).await {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// Waits until this direction may forward; false once the connection was cut.
async fn wait_open(
    mode: &mut watch::Receiver<Mode>,
    is_reply: bool,
    generation: &AtomicU64,
    born: u64,
) -> bool {
    loop {
        if generation.load(Ordering::SeqCst) != born {
            return false;
        }
        let m = *mode.borrow_and_update();
        if !(m == Mode::Hang || (is_reply && m == Mode::HangReplies)) {
            return true;
        }
        if mode.changed().await.is_err() {
            return false;
        }
    }
}
