//! Fault-injection points for the fault suite, compiled only with the `failpoints` cargo feature
//! (`.ci/run` enables it; a release build has none, which CI checks). Each point
//! is named by an environment variable holding a file path: while that file exists, a task that
//! reaches the point waits there: a process frozen at an exact place, on demand.

/// Waits at the point named by `var` while its file exists (and the variable is set). Called
/// through [`failpoint!`].
#[cfg(feature = "failpoints")]
pub(crate) async fn hold(var: &str, held: &str) {
    use std::time::Duration;
    let Some(path) = std::env::var_os(var).map(std::path::PathBuf::from) else {
        return;
    };
    if path.exists() {
        tracing::warn!(path = %path.display(), "fault injection: {held}");
        while path.exists() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tracing::warn!("fault injection: released ({held})");
    }
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
