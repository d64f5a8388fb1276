//! `copier-node status`: the cluster as the database sees it.

use sqlx::Connection;

use super::{CommandError, load};
use crate::cli::StatusArgs;
use crate::telemetry::{self, Output};
use crate::{cluster_status, db};

pub(super) async fn status(args: StatusArgs) -> Result<(), CommandError> {
    let (config, _) = load(args.db.config.as_deref(), &args.db.flags(), false)?;
    telemetry::init(config.log_format, Output::Stderr);
    let mut conn = db::admin_connect(&config.database_url).await?;
    let result = cluster_status::read(&mut conn).await;
    let _ = conn.close().await;
    let s = result.map_err(|e| {
        CommandError::failed(format!(
            "reading the cluster's state failed: {} (is the database migrated? run `copier-node migrate`)",
            db::describe(&e)
        ))
    })?;
    if args.json {
        println!("{}", serde_json::to_string(&s).expect("status serialises"));
    } else {
        print!("{}", cluster_status::render_text(&s));
    }
    Ok(())
}
