//! Fault-injection points for the fault suite, compiled only with the `failpoints` cargo feature
//! (`.ci/run` enables it; a release build has none, which CI checks). Each point
//! is named by an environment variable holding a file path: while that file exists, a task that
//! reaches the point waits there: a process frozen at an exact place, on demand.

/// Waits at the point named by `var` while its file exists (and the variable is set). Called
/// through [`failpoint!`].
#[cfg(feature = "failpoints")]
pub(crate) async fn hold(var: &str, held: &str) {
    let Some(path) = std::env::var_os(var).map(std::path::PathBuf::from) else {
        return;
    };
    if path.exists() {
        tracing::warn!(path = %path.display(), "fault injection: {held}");
        let mut present = watch(path);
        // The sender lives until it has said the file is gone.
        let _ = present.wait_for(|present| !present).await;
        tracing::warn!("fault injection: released ({held})");
    }
}

/// Whether the file at `path` is still there: one poll every 10 ms per held path, however many
/// tasks wait on it. (A poll per waiting task made a thousand sessions held at their start-up
/// a hundred thousand wake-ups a second: the node's own lease cycles slowed behind them.)
#[cfg(feature = "failpoints")]
fn watch(path: std::path::PathBuf) -> tokio::sync::watch::Receiver<bool> {
    use std::collections::HashMap;
    use std::sync::{LazyLock, Mutex};
    use std::time::Duration;
    use tokio::sync::watch;
    static HELD: LazyLock<Mutex<HashMap<std::path::PathBuf, watch::Receiver<bool>>>> =
        LazyLock::new(Mutex::default);
    let mut held = HELD.lock().expect("no panic while the map is held");
    if let Some(present) = held.get(&path)
        && *present.borrow()
    {
        return present.clone();
    }
    let (tx, present) = watch::channel(true);
    held.insert(path.clone(), present.clone());
    tokio::spawn(async move {
        while path.exists() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let _ = tx.send(false);
    });
    present
}

/// Whether the point named by `var` is on (its variable set and its file present): for points that
/// change what a unit of work does rather than hold it.
#[cfg(feature = "failpoints")]
pub(crate) fn active(var: &str) -> bool {
    std::env::var_os(var).is_some_and(|path| std::path::Path::new(&path).exists())
}

/// A fault-injection point: `failpoint!("COPIERTEST_NAME", "what is held")` in async code. Without
/// the `failpoints` feature it expands to nothing, so not even the point's name reaches a release
/// binary (CI greps for it).
macro_rules! failpoint {
    ($var:literal, $held:literal) => {
        #[cfg(feature = "failpoints")]
        {
            $crate::failpoints::hold($var, $held).await;
        }
    };
}
pub(crate) use failpoint;
