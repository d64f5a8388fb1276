//! `copier-node credentials keygen | encrypt | rotate`.

use sqlx::Connection;

use super::{CommandError, load};
use crate::cli::CredentialsCommand;
use crate::config::Layers;
use crate::credentials::{self, CredentialsKey};
use crate::db;

const NO_KEY: &str = "no credentials key: set COPIER_CREDENTIALS_KEY or `credentials_key_file` (make a key with `copier-node credentials keygen`)";

pub(super) async fn credentials(command: CredentialsCommand) -> Result<(), CommandError> {
    match command {
        CredentialsCommand::Keygen => println!("{}", CredentialsKey::generate().encode()),
        CredentialsCommand::Encrypt(args) => {
            let flags = [("credentials_key_file", args.credentials_key_file)];
            let key = Layers::load(args.config.as_deref(), std::env::vars(), &flags)?
                .credentials_key()?
                .ok_or_else(|| CommandError::usage(NO_KEY))?;
            let mut line = String::new();
            std::io::stdin().read_line(&mut line).map_err(|e| {
                CommandError::failed(format!("cannot read the password from standard input: {e}"))
            })?;
            let password = line.strip_suffix('\n').unwrap_or(&line);
            let password = password.strip_suffix('\r').unwrap_or(password);
            if password.is_empty() {
                return Err(CommandError::usage(
                    "no password on standard input (an account without a password leaves `credentials` NULL)",
                ));
            }
            println!("{}", key.encrypt(password));
        }
        CredentialsCommand::Rotate(args) => {
            let mut flags = args.db.flags();
            flags.push(("credentials_key_file", args.credentials_key_file.clone()));
            let (config, _) = load(args.db.config.as_deref(), &flags, false)?;
            let key = config.credentials_key.clone().ok_or_else(|| {
                CommandError::usage(
                    "no credentials key: set COPIER_CREDENTIALS_KEY (new key first: new,old) or `credentials_key_file`",
                )
            })?;
            let mut conn = db::admin_connect(&config.database_url).await?;
            let report = credentials::rotate(&mut conn, &key, args.encrypt_plaintext).await;
            let _ = conn.close().await;
            let report = report.map_err(|e| {
                CommandError::failed(format!("rotating credentials: {}", db::describe(&e)))
            })?;
            for problem in &report.problems {
                eprintln!("{problem}");
            }
            println!(
                "credentials: {} re-encrypted with the current key, {} plaintext encrypted, {} already current, {} left as they were",
                report.resealed,
                report.encrypted,
                report.current,
                report.problems.len()
            );
            if !report.problems.is_empty() {
                return Err(CommandError::failed(format!(
                    "{} stored values could not be brought to the current key",
                    report.problems.len()
                )));
            }
        }
    }
    Ok(())
}
