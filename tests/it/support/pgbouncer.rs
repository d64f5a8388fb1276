//! PgBouncer (Debian's 1.18) as a test child in front of the test PostgreSQL
//! ([`copier_node::pgtmp::PgBouncer`], shared with the benchmarks).

use std::path::Path;

use copier_node::pgtmp::PGBOUNCER;
pub use copier_node::pgtmp::PgBouncer;

/// Whether PgBouncer is installed; when it is not, a test may skip only outside CI
/// (`COPIER_REQUIRE_TOOLS` makes its absence a failure).
pub fn available() -> bool {
    let found = Path::new(PGBOUNCER).exists();
    if !found {
        assert!(
            std::env::var_os("COPIER_REQUIRE_TOOLS").is_none(),
            "pgbouncer is required (COPIER_REQUIRE_TOOLS is set) but not installed"
        );
        eprintln!("note: pgbouncer is not installed; this test is skipped here (CI installs it)");
    }
    found
}

/// Starts PgBouncer in `mode` with 40 server connections (see [`PgBouncer::start`]).
pub fn start(dir: &Path, server_url: &str, mode: &str, ignore: &str) -> PgBouncer {
    PgBouncer::start(dir, server_url, mode, ignore, 40).expect("starting pgbouncer")
}

/// As [`start`], with `pool_size` server connections (`default_pool_size`).
pub fn start_sized(
    dir: &Path,
    server_url: &str,
    mode: &str,
    ignore: &str,
    pool_size: u32,
) -> PgBouncer {
    PgBouncer::start(dir, server_url, mode, ignore, pool_size).expect("starting pgbouncer")
}
