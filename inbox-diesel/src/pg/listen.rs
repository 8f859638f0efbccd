//! PostgreSQL's LISTEN: a relay waits for [`OUTBOX_CHANNEL`]'s notifications of its
//! own schema on a dedicated connection.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::sql_types::Text;
use diesel::PgConnection;

use crate::backend::private::Sealed;
use crate::{Error, Result, OUTBOX_CHANNEL};

/// The first gap between two checks of the LISTEN connection in a wait: a relay
/// that has just finished a round checks densely, so under steady traffic a
/// notification is seen within a fraction of a millisecond.
const LISTEN_POLL_FIRST: Duration = Duration::from_micros(250);

/// The longest gap between two checks: the gap doubles from [`LISTEN_POLL_FIRST`]
/// while nothing comes, so an idle relay checks 200 times a second.
///
/// Polled rather than woken: diesel does not expose the connection's socket to wait
/// on, the workspace forbids the `unsafe` a libpq call of our own would need, and a
/// second PostgreSQL client (tokio-postgres) would bring its own TLS stack and URL
/// parsing for one connection. A check is one non-blocking `PQconsumeInput`.
const LISTEN_POLL: Duration = Duration::from_millis(5);

#[derive(QueryableByName)]
struct SchemaName {
    #[diesel(sql_type = Text)]
    name: String,
}

/// PostgreSQL: the store's dedicated LISTEN connection, outside the pool, opened on
/// the first wait and again after it breaks.
#[derive(Default)]
pub struct Listener {
    conn: Option<PgConnection>,
    /// The listening connection's schema: only its notifications wake this store.
    schema: String,
    /// Wake-ups seen so far; a waiter is woken when the count moves past its start.
    wakeups: u64,
}

impl Listener {
    /// Opens the connection if needed, then counts this schema's notifications;
    /// returns the count before and after.
    fn poll(&mut self, url: &str, schema: Option<&str>) -> Result<(u64, u64)> {
        let before = self.wakeups;
        let conn = match &mut self.conn {
            Some(conn) => conn,
            None => {
                let mut conn = <PgConnection as Sealed>::establish_url(url)
                    .map_err(|source| Error::connect(url, &source))?;
                <PgConnection as Sealed>::on_acquire(&mut conn, schema)?;
                let current: SchemaName =
                    diesel::sql_query("SELECT coalesce(current_schema(), '') AS name")
                        .get_result(&mut conn)?;
                conn.batch_execute(&format!("LISTEN {OUTBOX_CHANNEL}"))?;
                self.schema = current.name;
                // A message enqueued before LISTEN sent no notification we can see:
                // a fresh connection counts as a wake-up, so the relay leases again.
                self.wakeups += 1;
                self.conn.insert(conn)
            }
        };
        // diesel's iterator does not end at an error: on a broken connection it
        // yields the error again and again (libpq's message growing each time), so
        // the first error ends the check.
        let mut broken = None;
        for notification in conn.notifications_iter() {
            match notification {
                Ok(n) if n.channel == OUTBOX_CHANNEL && n.payload == self.schema => {
                    self.wakeups += 1;
                }
                Ok(_) => {}
                Err(err) => {
                    broken = Some(err);
                    break;
                }
            }
        }
        if let Some(err) = broken {
            // Broken: the next wait opens a new connection.
            self.conn = None;
            return Err(err.into());
        }
        Ok((before, self.wakeups))
    }
}

/// Waits up to `timeout` (wall time) for a notification of this schema; `false` when
/// none came.
pub(super) fn wait(
    listener: &Mutex<Listener>,
    url: &str,
    schema: Option<&str>,
    timeout: Duration,
) -> Result<bool> {
    let deadline = Instant::now().checked_add(timeout);
    let mut start = None;
    let mut gap = LISTEN_POLL_FIRST;
    loop {
        // The lock is held only while checking, never while sleeping.
        let (before, after) = listener
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .poll(url, schema)?;
        let start = *start.get_or_insert(before);
        if after > start {
            return Ok(true);
        }
        let now = Instant::now();
        let step = match deadline {
            Some(deadline) if now >= deadline => return Ok(false),
            Some(deadline) => gap.min(deadline - now),
            None => gap,
        };
        std::thread::sleep(step);
        gap = (gap * 2).min(LISTEN_POLL);
    }
}
