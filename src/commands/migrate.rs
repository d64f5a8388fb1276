//! `copier-node migrate`: apply pending migrations and exit.

use anyhow::Context;
use sqlx::Connection;

use super::{CommandError, load};
use crate::cli::DbArgs;
use crate::db;
use crate::telemetry::{self, Output};

pub(super) async fn migrate(args: DbArgs) -> Result<(), CommandError> {
    let (config, _) = load(args.config.as_deref(), &args.flags(), false)?;
    telemetry::init(config.log_format, Output::Stderr);
    let mut conn = db::admin_connect(&config.database_url).await?;
    let applied = db::migrate::apply(&mut conn)
        .await
        .context("applying migrations")?;
    let _ = conn.close().await;
    if applied.is_empty() {
        println!("no pending migrations");
    } else {
        let list: Vec<String> = applied.iter().map(i64::to_string).collect();
        println!("applied migrations: {}", list.join(", "));
    }
    Ok(())
}
