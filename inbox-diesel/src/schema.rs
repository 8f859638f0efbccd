//! Diesel table definitions, one set for both backends: the backends differ only in
//! how a timestamp is stored (TIMESTAMPTZ on PostgreSQL, RFC 3339 text on SQLite),
//! and [`sql_types::StoreTime`] is that column type on each (written from a
//! [`sql_types::Stamp`], read as a `DateTime<Utc>`).
//!
//! With one table set the statements no longer had to be macros expanded per
//! backend: lines inside `macro_rules!` blocks of `src/` went from 1,658 (16 macros)
//! to 710 (12), and the 13 `table!` blocks, all of them inside macros expanded once
//! per backend (26 tables), are 13 plain ones (13 tables).

/// The crate's own SQL type, and the value that binds to it.
pub(crate) mod sql_types {
    use chrono::{DateTime, Utc};

    /// A timestamp column as the store's migrations create it: `timestamptz` on
    /// PostgreSQL (diesel's `Timestamptz`, oid 1184, with no catalog lookup), text
    /// on SQLite (diesel's `TimestamptzSqlite`). Values are written and read exactly
    /// as those types write and read them, so one table definition serves both
    /// backends. Columns read as [`DateTime<Utc>`]; a value is written as a
    /// [`Stamp`].
    #[derive(
        Debug, Clone, Copy, Default, diesel::query_builder::QueryId, diesel::sql_types::SqlType,
    )]
    #[diesel(postgres_type(oid = 1184, array_oid = 1185))]
    #[diesel(sqlite_type(name = "Text"))]
    pub struct StoreTime;

    /// Ordered as time: `MIN`/`MAX` over it are the earliest and latest (on SQLite
    /// the store's text, `%F %T%.f+00:00` in UTC, sorts as the times do).
    impl diesel::sql_types::SqlOrd for StoreTime {}

    /// A [`DateTime<Utc>`] bound to a [`StoreTime`] column or parameter.
    ///
    /// A newtype because `AsExpression<StoreTime>` cannot be implemented for
    /// `DateTime<Utc>` itself outside diesel: diesel's blanket impl for every
    /// `Expression` could cover a foreign type (E0119), so a custom SQL type needs a
    /// local Rust type to be written from (diesel's own guide derives
    /// `AsExpression` on a local type). Reading needs none: `FromSql<StoreTime, _>`
    /// is implemented for `DateTime<Utc>`.
    #[derive(Debug, Clone, Copy, diesel::expression::AsExpression)]
    #[diesel(sql_type = StoreTime)]
    pub(crate) struct Stamp(pub(crate) DateTime<Utc>);

    #[cfg(feature = "postgres")]
    mod pg {
        use chrono::{DateTime, Utc};
        use diesel::deserialize::{self, FromSql};
        use diesel::pg::{Pg, PgValue};
        use diesel::serialize::{self, Output, ToSql};
        use diesel::sql_types::Timestamptz;

        use super::{Stamp, StoreTime};

        impl ToSql<StoreTime, Pg> for Stamp {
            fn to_sql<'b>(&'b self, out: &mut Output<'b, '_, Pg>) -> serialize::Result {
                <DateTime<Utc> as ToSql<Timestamptz, Pg>>::to_sql(&self.0, out)
            }
        }

        impl FromSql<StoreTime, Pg> for DateTime<Utc> {
            fn from_sql(bytes: PgValue<'_>) -> deserialize::Result<Self> {
                <Self as FromSql<Timestamptz, Pg>>::from_sql(bytes)
            }
        }
    }

    #[cfg(feature = "sqlite")]
    mod sqlite {
        use chrono::{DateTime, Utc};
        use diesel::backend::Backend;
        use diesel::deserialize::{self, FromSql};
        use diesel::serialize::{self, Output, ToSql};
        use diesel::sql_types::TimestamptzSqlite;
        use diesel::sqlite::Sqlite;

        use super::{Stamp, StoreTime};

        impl ToSql<StoreTime, Sqlite> for Stamp {
            fn to_sql<'b>(&'b self, out: &mut Output<'b, '_, Sqlite>) -> serialize::Result {
                <DateTime<Utc> as ToSql<TimestamptzSqlite, Sqlite>>::to_sql(&self.0, out)
            }
        }

        impl FromSql<StoreTime, Sqlite> for DateTime<Utc> {
            fn from_sql(value: <Sqlite as Backend>::RawValue<'_>) -> deserialize::Result<Self> {
                <Self as FromSql<TimestamptzSqlite, Sqlite>>::from_sql(value)
            }
        }
    }
}

pub(crate) use sql_types::Stamp;

diesel::table! {
    use diesel::sql_types::*;
    use super::sql_types::StoreTime;

    /// A consumer group halted by a claim invariant violation (the operator
    /// migration's table; the consumer records and reads it).
    inbox_group_halts (consumer_group) {
        consumer_group -> Text,
        message_key -> Text,
        detail -> Text,
        halted_at -> StoreTime,
    }
}

diesel::table! {
    use diesel::sql_types::*;
    use super::sql_types::StoreTime;

    inbox_claims (consumer_group, message_key) {
        consumer_group -> Text,
        message_key -> Text,
        message_type -> Text,
        tenant -> Nullable<Text>,
        payload_digest -> Binary,
        status -> Text,
        attempts -> Integer,
        starts -> Integer,
        next_attempt_at -> Nullable<StoreTime>,
        last_error -> Nullable<Text>,
        payload -> Nullable<Binary>,
        first_seen_at -> StoreTime,
        updated_at -> StoreTime,
    }
}

diesel::table! {
    use diesel::sql_types::*;
    use super::sql_types::StoreTime;

    inbox_dead_letters (id) {
        id -> BigInt,
        consumer_group -> Text,
        message_key -> Text,
        message_type -> Text,
        tenant -> Nullable<Text>,
        payload -> Binary,
        headers -> Text,
        attempts -> Integer,
        reason -> Text,
        last_error -> Nullable<Text>,
        dead_lettered_at -> StoreTime,
        replayed_at -> Nullable<StoreTime>,
        payload_length -> Nullable<BigInt>,
        payload_sha256 -> Nullable<Binary>,
        failure_group -> Nullable<Text>,
    }
}

diesel::table! {
    use diesel::sql_types::*;
    use super::sql_types::StoreTime;

    outbox_messages (id) {
        id -> BigInt,
        message_key -> Text,
        exchange -> Text,
        routing_key -> Text,
        message_type -> Text,
        tenant -> Nullable<Text>,
        payload -> Binary,
        headers -> Text,
        ordering_key -> Nullable<Text>,
        created_at -> StoreTime,
        available_at -> StoreTime,
        leased_until -> Nullable<StoreTime>,
        leased_by -> Nullable<Text>,
        published_at -> Nullable<StoreTime>,
        attempts -> Integer,
        last_error -> Nullable<Text>,
    }
}

diesel::table! {
    use diesel::sql_types::*;
    use super::sql_types::StoreTime;

    /// The same table, as the statements about a row's fate see it: diesel's
    /// tables stop at 16 columns, so `dead_at` is reached through this one.
    /// PostgreSQL's `xact_id xid8` (the writing transaction) is in neither: it
    /// is read only by the lease's SQL, and diesel has no xid8 type.
    #[sql_name = "outbox_messages"]
    outbox_fates (id) {
        id -> BigInt,
        message_key -> Text,
        exchange -> Text,
        routing_key -> Text,
        message_type -> Text,
        ordering_key -> Nullable<Text>,
        created_at -> StoreTime,
        available_at -> StoreTime,
        leased_until -> Nullable<StoreTime>,
        leased_by -> Nullable<Text>,
        published_at -> Nullable<StoreTime>,
        attempts -> Integer,
        last_error -> Nullable<Text>,
        dead_at -> Nullable<StoreTime>,
    }
}

#[cfg(test)]
mod tests {
    use chrono::{DateTime, Utc};
    use diesel::dsl::sql;
    use diesel::prelude::*;
    use diesel::sql_types::Text;

    use super::sql_types::{Stamp, StoreTime};

    fn instant() -> DateTime<Utc> {
        DateTime::parse_from_rfc3339("2024-05-06T07:08:09.123456Z")
            .unwrap()
            .with_timezone(&Utc)
    }

    /// What SQLite stores for a `StoreTime` is what it stores for diesel's
    /// `TimestamptzSqlite`, and both read back the same instant.
    #[cfg(feature = "sqlite")]
    #[test]
    fn sqlite_stores_a_store_time_as_diesel_stores_a_timestamptz() {
        use diesel::sql_types::TimestamptzSqlite;
        let conn = &mut SqliteConnection::establish(":memory:").unwrap();
        let ours: String = diesel::select(
            sql::<Text>("CAST(")
                .bind::<StoreTime, _>(Stamp(instant()))
                .sql(" AS TEXT)"),
        )
        .get_result(conn)
        .unwrap();
        let diesels: String = diesel::select(
            sql::<Text>("CAST(")
                .bind::<TimestamptzSqlite, _>(instant())
                .sql(" AS TEXT)"),
        )
        .get_result(conn)
        .unwrap();
        assert_eq!(ours, diesels);
        let read: DateTime<Utc> = diesel::select(sql::<StoreTime>("").bind::<Text, _>(&ours))
            .get_result(conn)
            .unwrap();
        assert_eq!(read, instant());
    }

    /// PostgreSQL receives a `StoreTime` as a `timestamptz` (oid 1184) and reads
    /// one back as diesel's `Timestamptz` does.
    #[cfg(feature = "postgres")]
    #[test]
    fn postgres_binds_a_store_time_as_a_timestamptz() {
        use diesel::connection::SimpleConnection;
        use diesel::sql_types::Timestamptz;
        let Some(url) = inbox_test_support::postgres_url() else {
            return;
        };
        let conn = &mut PgConnection::establish(&url).unwrap();
        conn.batch_execute("SET TIME ZONE 'UTC'").unwrap();
        let ours: String = diesel::select(
            sql::<Text>("pg_typeof(")
                .bind::<StoreTime, _>(Stamp(instant()))
                .sql(")::text || ' ' || (")
                .bind::<StoreTime, _>(Stamp(instant()))
                .sql(")::text"),
        )
        .get_result(conn)
        .unwrap();
        assert_eq!(
            ours,
            "timestamp with time zone 2024-05-06 07:08:09.123456+00"
        );
        let read: DateTime<Utc> = diesel::select(
            sql::<StoreTime>("")
                .bind::<Timestamptz, _>(instant())
                .sql("::timestamptz"),
        )
        .get_result(conn)
        .unwrap();
        assert_eq!(read, instant());
    }
}
