//! `copier-node sim-broker`: the simulated trade server and its hand tools.

use std::time::Duration;

use super::CommandError;
use crate::broker::types::{PendingKind, PlaceOrder};
use crate::cli::{SimBrokerCommand, TradeAction};
use crate::config::{LogFormat, parse_duration};
use crate::shutdown;
use crate::sim_broker::market::Sessions;
use crate::sim_broker::tools::{self, HandOrder};
use crate::sim_broker::{ServeOptions, SimBroker};
use crate::telemetry::{self, Output};

pub(super) async fn sim_broker(command: SimBrokerCommand) -> Result<(), CommandError> {
    telemetry::init(LogFormat::Text, Output::Stderr);
    let failed = |e: crate::broker::BrokerError| CommandError::failed(e.to_string());
    match command {
        SimBrokerCommand::Serve(args) => {
            let stop = shutdown::signal_received();
            let price_walk = args
                .price_walk
                .as_deref()
                .map(parse_duration)
                .transpose()
                .map_err(|e| CommandError::usage(format!("invalid --price-walk: {e}")))?;
            let options = ServeOptions {
                listen: args.listen,
                journal: args.journal,
                state: args.state,
                fence_check: !args.no_fence_check,
                dedupe: !args.no_dedupe,
                mt4: args.mt4,
                reply_first: args.reply_first,
                balance: args.balance,
                balances: Default::default(),
                price_walk,
                contract_sizes: key_values(
                    &args.contract_size,
                    "--contract-size",
                    "SYMBOL=UNITS",
                    |v| {
                        v.parse()
                            .ok()
                            .filter(|u: &f64| *u > 0.0)
                            .ok_or_else(|| "units must be a positive number".to_string())
                    },
                )?,
                currencies: key_values(&args.currency, "--currency", "LOGIN=CURRENCY", |v| {
                    v.parse::<crate::broker::types::Currency>()
                        .map_err(|e| e.to_string())
                })?,
                clock_offset_ms: parse_utc_offset(&args.utc_offset)
                    .map_err(|e| CommandError::usage(format!("invalid --utc-offset: {e}")))?,
                sessions: key_values(
                    &args.session,
                    "--session",
                    "SYMBOL=HH:MM-HH:MM[,...]",
                    Sessions::parse,
                )?,
                symbol_suffixes: if args.symbol_suffix.is_empty() {
                    vec![String::new(), ".m".to_string()]
                } else {
                    args.symbol_suffix
                },
                login_delay: request_delay(&args.login_delay, "--login-delay")?,
                read_delay: request_delay(&args.read_delay, "--read-delay")?,
                reads_as_of_request: args.reads_as_of_request,
                journal_reads: args.journal_reads,
                fence_request: !args.no_fence_request,
            };
            let server = SimBroker::start(options).await?;
            stop.await;
            server.stop().await;
        }
        SimBrokerCommand::Trade(args) => {
            let order = match args.action {
                TradeAction::Open {
                    symbol,
                    side,
                    volume,
                    sl,
                    tp,
                    magic,
                    comment,
                } => HandOrder::Open {
                    symbol,
                    side: side.parse().map_err(CommandError::usage)?,
                    volume,
                    sl,
                    tp,
                    magic,
                    comment,
                },
                TradeAction::Close { ticket, volume } => HandOrder::Close { ticket, volume },
                TradeAction::Modify { ticket, sl, tp } => HandOrder::Modify { ticket, sl, tp },
                TradeAction::Place {
                    symbol,
                    side,
                    kind,
                    price,
                    volume,
                    sl,
                    tp,
                    expiry_ms,
                    magic,
                    comment,
                } => HandOrder::Place(PlaceOrder {
                    symbol,
                    side: side.parse().map_err(CommandError::usage)?,
                    kind: match kind.as_str() {
                        "limit" => PendingKind::Limit,
                        "stop" => PendingKind::Stop,
                        other => {
                            return Err(CommandError::usage(format!(
                                "kind {other:?}: expected limit or stop"
                            )));
                        }
                    },
                    price,
                    volume,
                    sl,
                    tp,
                    expiry_ms,
                    magic,
                    comment,
                    client_order_id: None,
                }),
                TradeAction::Amend {
                    ticket,
                    price,
                    sl,
                    tp,
                    expiry_ms,
                } => HandOrder::Amend {
                    ticket,
                    price,
                    sl,
                    tp,
                    expiry_ms,
                },
                TradeAction::Cancel { ticket } => HandOrder::Cancel { ticket },
            };
            let ticket = tools::trade(&args.account.broker, &args.account.login, order)
                .await
                .map_err(failed)?;
            if let Some(ticket) = ticket {
                println!("{ticket}");
            }
        }
        SimBrokerCommand::Positions(args) => print_lines(
            &tools::positions(&args.broker, &args.login)
                .await
                .map_err(failed)?,
        )?,
        SimBrokerCommand::Orders(args) => print_lines(
            &tools::orders(&args.broker, &args.login)
                .await
                .map_err(failed)?,
        )?,
        SimBrokerCommand::History(args) => print_lines(
            &tools::history(&args.broker, &args.login)
                .await
                .map_err(failed)?,
        )?,
        SimBrokerCommand::Price(args) => {
            let moved = tools::set_price_of(&args.broker, &args.symbol, args.price, args.variants)
                .await
                .map_err(failed)?;
            println!("{} set to {}", moved.join(", "), args.price);
        }
    }
    Ok(())
}

/// `KEY=VALUE` flags (repeated) into a map, each value parsed by `parse`; a usage error names the
/// flag, the argument and what was expected.
fn key_values<T>(
    args: &[String],
    flag: &str,
    shape: &str,
    parse: impl Fn(&str) -> Result<T, String>,
) -> Result<std::collections::HashMap<String, T>, CommandError> {
    args.iter()
        .map(|kv| {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| CommandError::usage(format!("{flag} {kv}: expected {shape}")))?;
            let value = parse(v).map_err(|e| CommandError::usage(format!("{flag} {kv}: {e}")))?;
            Ok((k.to_string(), value))
        })
        .collect()
}

/// One JSON line per item on stdout.
fn print_lines<T: serde::Serialize>(items: &[T]) -> Result<(), CommandError> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    for item in items {
        let line = serde_json::to_string(item).expect("broker types serialise");
        writeln!(out, "{line}")
            .map_err(|e| CommandError::failed(format!("writing stdout: {e}")))?;
    }
    Ok(())
}

/// `[+-]HH:MM` as milliseconds.
fn parse_utc_offset(text: &str) -> Result<i64, String> {
    let bad = || format!("{text:?} is not [+-]HH:MM (e.g. +02:00)");
    let (sign, rest) = match text.as_bytes().first() {
        Some(b'+') => (1, &text[1..]),
        Some(b'-') => (-1, &text[1..]),
        _ => return Err(bad()),
    };
    let (h, m) = rest.split_once(':').ok_or_else(bad)?;
    let (h, m): (i64, i64) = (h.parse().map_err(|_| bad())?, m.parse().map_err(|_| bad())?);
    if h.to_string().len() > 2
        || !(0..=14).contains(&h)
        || !(0..60).contains(&m)
        || h * 60 + m > 14 * 60
    {
        return Err(bad());
    }
    Ok(sign * (h * 3_600_000 + m * 60_000))
}

/// A delay option's value: at most 5 s (clients give a request 10 s).
fn request_delay(value: &str, option: &str) -> Result<Duration, CommandError> {
    parse_duration(value)
        .and_then(|d| {
            if d <= Duration::from_secs(5) {
                Ok(d)
            } else {
                Err("at most 5s (clients give a request 10 s)".to_string())
            }
        })
        .map_err(|e| CommandError::usage(format!("invalid {option}: {e}")))
}

#[cfg(test)]
mod utc_offset_tests {
    use super::parse_utc_offset;

    #[test]
    fn utc_offsets_parse_and_refuse_nonsense() {
        assert_eq!(parse_utc_offset("+02:00"), Ok(7_200_000));
        assert_eq!(parse_utc_offset("-05:30"), Ok(-19_800_000));
        assert_eq!(parse_utc_offset("+00:00"), Ok(0));
        for bad in ["2:00", "+2", "+15:00", "+02:60", "+aa:00", "", "+02:00x"] {
            assert!(parse_utc_offset(bad).is_err(), "{bad}");
        }
    }
}
