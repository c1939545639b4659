//! The write queue: fills and lock releases, sent in order by one task,
//! off the request path.

use std::sync::atomic::Ordering::Relaxed;

use bytes::Bytes;
use fred::prelude::{
    Expiration, KeysInterface, LuaInterface, PubsubInterface, SetsInterface, Value,
};
use fred::types::ExpireOptions;
use tokio::sync::mpsc;

use crate::lock::{SHARED_ANSWER_TTL, UNLOCK_SCRIPT};
use crate::tier::Inner;

/// What the writer task does, in queue order.
pub(crate) enum Write {
    /// Sends a command (skipped while the breaker is open).
    Command(Command),
    /// Answers once every write queued before it is done.
    Flush(tokio::sync::oneshot::Sender<()>),
}

/// A queued command.
pub(crate) enum Command {
    /// `SET key value PX px`, then the key's hash into each tag set.
    Set {
        key: String,
        value: Bytes,
        px: i64,
        tags: Vec<String>,
        member: String,
    },
    /// Release a fill lock and announce how the fill ended (`message`:
    /// see [`unlock_message`]), after the writes queued before it.
    Unlock {
        lock: String,
        channel: String,
        shared: String,
        token: Bytes,
        message: Bytes,
    },
}

/// Drains the write queue in order; ends when the tier is dropped.
pub(crate) async fn writer(tier: std::sync::Weak<Inner>, mut rx: mpsc::Receiver<Write>) {
    while let Some(write) = rx.recv().await {
        let Some(inner) = tier.upgrade() else {
            return;
        };
        let command = match write {
            Write::Flush(done) => {
                let _ = done.send(());
                continue;
            }
            Write::Command(command) => command,
        };
        let releasing = match &command {
            Command::Unlock { token, .. } => Some(token.clone()),
            Command::Set { .. } => None,
        };
        if !inner.breaker.allow() {
            inner.skipped.fetch_add(1, Relaxed);
            releasing.inspect(|t| inner.released(t));
            continue;
        }
        let done = tokio::time::timeout(inner.command_timeout, apply(&inner, command)).await;
        releasing.inspect(|t| inner.released(t));
        match done {
            Ok(Ok(())) => inner.breaker.success(),
            _ => {
                inner.write_errors.fetch_add(1, Relaxed);
                inner.breaker.failure();
            }
        }
    }
}

async fn apply(inner: &Inner, command: Command) -> Result<(), fred::error::Error> {
    let client = &inner.client;
    match command {
        Command::Set {
            key,
            value,
            px,
            tags,
            member,
        } => {
            client
                .set::<(), _, _>(key, value, Some(Expiration::PX(px)), None, false)
                .await?;
            for set in tags {
                // The set lives as long as its longest-lived member.
                client.sadd::<i64, _, _>(&set, member.as_str()).await?;
                client
                    .pexpire::<i64, _>(&set, px, Some(ExpireOptions::NX))
                    .await?;
                client
                    .pexpire::<i64, _>(&set, px, Some(ExpireOptions::GT))
                    .await?;
            }
            Ok(())
        }
        Command::Unlock {
            lock,
            channel,
            shared,
            token,
            message,
        } => {
            // A shared answer is also left for a moment where a waiter that
            // subscribed too late (and so found the lock gone) reads it.
            if message.len() > 1 {
                let px = Expiration::PX(SHARED_ANSWER_TTL.as_millis() as i64);
                client
                    .set::<(), _, _>(shared, message.clone(), Some(px), None, false)
                    .await?;
            }
            client
                .eval::<i64, _, _, _>(UNLOCK_SCRIPT, vec![lock], vec![Value::from(token)])
                .await?;
            client.spublish::<i64, _, _>(channel, message).await?;
            Ok(())
        }
    }
}
