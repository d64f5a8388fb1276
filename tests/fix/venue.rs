//! The FIX 4.4 test venue (`acceptor.cpp`, on QuickFIX C++) as a process: built once per source
//! version with g++ against Debian's `libquickfix-dev` (cached under the target directory by the
//! source's hash), started with its sessions, driven through its control port. Shared by the
//! integration tests (`tests/it/support/fix.rs`) and the benchmarks (`benches/copier/fix.rs`),
//! which include this file by path; it depends on nothing but std.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

const SOURCE: &str = include_str!("acceptor.cpp");

/// The venue binary, compiled on first use (cached under the target dir by the source's hash).
pub fn acceptor_binary() -> &'static PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let hash = SOURCE.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fix-acceptor");
        std::fs::create_dir_all(&dir).unwrap();
        let bin = dir.join(format!("fix-acceptor-{hash:016x}"));
        // One build at a time (nextest runs each test in its own process): the first to create
        // the lock directory builds, the others wait for the binary (or build anyway after a
        // minute, should a builder have died holding the lock).
        let lock = dir.join(format!("fix-acceptor-{hash:016x}.lock"));
        let builder = std::fs::create_dir(&lock).is_ok();
        if !builder {
            for _ in 0..1200 {
                if bin.exists() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        if !bin.exists() {
            let tmp = dir.join(format!(
                "build-{}-{:08x}",
                std::process::id(),
                fastrand::u32(..)
            ));
            let source = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fix/acceptor.cpp");
            let out = Command::new("g++")
                .args(["-std=c++14", "-O1", "-Wall", "-Wno-deprecated", "-o"])
                .arg(&tmp)
                .arg(source)
                .args(["-lquickfix", "-lpthread"])
                .output()
                .expect("running g++ (the FIX venue needs g++ and libquickfix-dev)");
            assert!(
                out.status.success(),
                "building the FIX venue failed (apt-get install libquickfix-dev g++):\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            std::fs::rename(&tmp, &bin).unwrap();
        }
        if builder {
            let _ = std::fs::remove_dir(&lock);
        }
        bin
    })
}

/// An account the venue knows: its login (the session's TargetCompID) and password.
pub struct VenueAccount<'a> {
    pub login: &'a str,
    pub password: &'a str,
}

/// A running venue.
pub struct FixVenue {
    child: Child,
    pub port: u16,
    control_port: u16,
    pub journal: PathBuf,
    pub comp_id: String,
}

impl FixVenue {
    /// Starts the venue on free ports. A port found free by `bind(0)` can be taken by another
    /// test's process before the venue binds it ("Address already in use"): the venue is then
    /// started again on other ports, a few times.
    pub fn start(dir: &Path, accounts: &[VenueAccount<'_>]) -> FixVenue {
        const ATTEMPTS: usize = 5;
        for attempt in 1..=ATTEMPTS {
            match Self::try_start(dir, accounts) {
                Ok(venue) => return venue,
                Err(why) if attempt < ATTEMPTS => {
                    eprintln!("the FIX venue did not start ({why}); again on other ports");
                }
                Err(why) => panic!("the FIX venue did not start in {ATTEMPTS} attempts: {why}"),
            }
        }
        unreachable!("the loop returns or panics")
    }

    fn try_start(dir: &Path, accounts: &[VenueAccount<'_>]) -> Result<FixVenue, String> {
        let port = free_port();
        let control_port = free_port();
        let logs = dir.join("fix-logs");
        std::fs::create_dir_all(&logs).unwrap();
        let mut settings = format!(
            "[DEFAULT]\nConnectionType=acceptor\nSocketAcceptPort={port}\nSocketReuseAddress=Y\n\
             StartTime=00:00:00\nEndTime=00:00:00\nBeginString=FIX.4.4\nSenderCompID=VENUE\n\
             UseDataDictionary=N\nFileLogPath={}\n",
            logs.display()
        );
        for a in accounts {
            settings.push_str(&format!(
                "\n[SESSION]\nTargetCompID={}\nPassword={}\n",
                a.login, a.password
            ));
        }
        let settings_path = dir.join("fix-venue.cfg");
        std::fs::write(&settings_path, settings).unwrap();
        let journal = dir.join("fix-journal.jsonl");
        let mut child = Command::new(acceptor_binary())
            .arg(&settings_path)
            .arg(&journal)
            .arg(control_port.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut first = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut first)
            .unwrap();
        if !first.contains("ready") {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("its first line: {first:?}"));
        }
        Ok(FixVenue {
            child,
            port,
            control_port,
            journal,
            comp_id: "VENUE".into(),
        })
    }

    /// One control command (see the venue's header); returns its answer line.
    pub fn control(&self, command: &str) -> String {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.control_port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(format!("{command}\n").as_bytes()).unwrap();
        let mut line = String::new();
        BufReader::new(s).read_line(&mut line).unwrap();
        line.trim().to_string()
    }
}

impl Drop for FixVenue {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
