//! Tells the operator on stderr why L2 is off: the shared tier's
//! connection failures (refused, a TLS handshake, a password) as they
//! change, once a minute while the same one repeats, and when Valkey is
//! connected again; never more than a line every ten seconds. Requests
//! never show them: each goes on to the origin.

use std::time::Duration;

use tiercache_core::Tier;
use tiercache_valkey::ValkeyTier;

/// Repeats of one failure are told at most this often.
const REPEAT_EVERY: Duration = Duration::from_secs(60);
/// Lines of any kind, at most this often (a flapping server).
const LINE_EVERY: Duration = Duration::from_secs(10);

/// Watches `l2` once a second, for as long as the proxy runs.
pub(crate) fn tell(l2: ValkeyTier) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The failure last told, and when; when any line was.
        let mut told: Option<(String, tokio::time::Instant)> = None;
        let mut last_line: Option<tokio::time::Instant> = None;
        let mut counted = 0;
        let mut down = false;
        loop {
            tick.tick().await;
            let too_soon = last_line.is_some_and(|at| at.elapsed() < LINE_EVERY);
            let report = l2.report();
            if report.connection_errors > counted {
                counted = report.connection_errors;
                down = true;
                let Some(failure) = l2.last_failure() else {
                    continue;
                };
                let repeat = told.as_ref().is_some_and(|(message, at)| {
                    *message == failure.message && at.elapsed() < REPEAT_EVERY
                });
                if !repeat && !too_soon {
                    eprintln!(
                        "tiercache-proxy: Valkey: {} ({counted} connection failures so far; requests go on to the origin)",
                        failure.message
                    );
                    told = Some((failure.message, tokio::time::Instant::now()));
                    last_line = Some(tokio::time::Instant::now());
                }
            } else if down && !too_soon && !report.breaker_open && l2.is_connected() {
                // Said only on fred's word that both clients are connected
                // (a quiet second is no sign: a server that accepts and
                // never answers fails a connection only per timeout).
                eprintln!("tiercache-proxy: Valkey: connected again");
                down = false;
                last_line = Some(tokio::time::Instant::now());
            }
        }
    })
}
