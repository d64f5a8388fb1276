//! Fault-injection points for the fault suite, compiled only with the `failpoints` cargo feature
//! (the README's test command enables it; a release build has none, which CI checks). Each point
//! is named by an environment variable holding a file path: while that file exists, a task that
//! reaches the point waits there: a process frozen at an exact place, on demand.

/// Waits at the point named by `var` while its file exists (and the variable is set). Without
/// the `failpoints` feature this is nothing at all.
#[cfg(feature = "failpoints")]
pub async fn hold(var: &str, held: &str) {
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

#[cfg(not(feature = "failpoints"))]
pub async fn hold(_var: &str, _held: &str) {}
