//! The command line (SPEC section 4). Flag values stay text here and are parsed with the other
//! configuration layers, so a bad flag gets the same located error as a bad file entry.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "copier-node",
    version,
    about = "Node daemon of a cloud trade copier: holds broker sessions under database leases"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the node daemon.
    Run(Box<RunArgs>),
    /// Apply pending migrations and exit (safe to run from many replicas at once).
    Migrate(DbArgs),
}

/// Flags every command that touches the database takes.
#[derive(Debug, Args)]
pub struct DbArgs {
    /// TOML configuration file.
    #[arg(long, value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// PostgreSQL connection string (prefer DATABASE_URL or COPIER_DATABASE_URL in production).
    #[arg(long, value_name = "URL")]
    pub database_url: Option<String>,
}

impl DbArgs {
    pub fn flags(&self) -> Vec<(&'static str, Option<String>)> {
        vec![("database_url", self.database_url.clone())]
    }
}

#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// The platform this node serves, e.g. mt5.
    #[arg(long)]
    pub platform: Option<String>,
    /// This node's identity (default <platform>-<hostname>).
    #[arg(long)]
    pub node_id: Option<String>,
    /// Most accounts this node owns (default 100).
    #[arg(long)]
    pub capacity: Option<String>,
    /// Lease length written to the database (default 60s).
    #[arg(long)]
    pub lease: Option<String>,
    /// How much earlier than the lease the node stops trusting it (default 15s).
    #[arg(long)]
    pub fence: Option<String>,
    /// Period of the lease cycle (default 20s).
    #[arg(long)]
    pub cycle: Option<String>,
    /// Health and metrics endpoint (default 0.0.0.0:9464).
    #[arg(long)]
    pub http_listen: Option<String>,
    /// text or json (default text).
    #[arg(long)]
    pub log_format: Option<String>,
    /// Direct connection for LISTEN (default: database_url).
    #[arg(long, value_name = "URL")]
    pub listen_database_url: Option<String>,
    /// Apply pending migrations before starting instead of refusing to start.
    #[arg(long)]
    pub migrate: bool,
}

impl RunArgs {
    pub fn flags(&self) -> Vec<(&'static str, Option<String>)> {
        let mut flags = self.db.flags();
        flags.extend([
            ("platform", self.platform.clone()),
            ("node_id", self.node_id.clone()),
            ("capacity", self.capacity.clone()),
            ("lease", self.lease.clone()),
            ("fence", self.fence.clone()),
            ("cycle", self.cycle.clone()),
            ("http_listen", self.http_listen.clone()),
            ("log_format", self.log_format.clone()),
            ("listen_database_url", self.listen_database_url.clone()),
        ]);
        flags
    }
}
