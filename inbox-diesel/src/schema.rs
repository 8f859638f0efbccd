//! Diesel table definitions, one module per backend: they differ only in how a
//! timestamp is stored (TIMESTAMPTZ on PostgreSQL, RFC 3339 text on SQLite).

macro_rules! inbox_tables {
    ($ts:ident) => {
        diesel::table! {
            use diesel::sql_types::*;

            /// A consumer group halted by a claim invariant violation (the operator
            /// migration's table; the consumer records and reads it).
            inbox_group_halts (consumer_group) {
                consumer_group -> Text,
                message_key -> Text,
                detail -> Text,
                halted_at -> $ts,
            }
        }

        diesel::table! {
            use diesel::sql_types::*;

            inbox_claims (consumer_group, message_key) {
                consumer_group -> Text,
                message_key -> Text,
                message_type -> Text,
                tenant -> Nullable<Text>,
                payload_digest -> Binary,
                status -> Text,
                attempts -> Integer,
                starts -> Integer,
                next_attempt_at -> Nullable<$ts>,
                last_error -> Nullable<Text>,
                payload -> Nullable<Binary>,
                first_seen_at -> $ts,
                updated_at -> $ts,
            }
        }

        diesel::table! {
            use diesel::sql_types::*;

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
                dead_lettered_at -> $ts,
                replayed_at -> Nullable<$ts>,
                payload_length -> Nullable<BigInt>,
                payload_sha256 -> Nullable<Binary>,
            }
        }

        diesel::table! {
            use diesel::sql_types::*;

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
                created_at -> $ts,
                available_at -> $ts,
                leased_until -> Nullable<$ts>,
                leased_by -> Nullable<Text>,
                published_at -> Nullable<$ts>,
                attempts -> Integer,
                last_error -> Nullable<Text>,
            }
        }

        diesel::table! {
            use diesel::sql_types::*;

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
                created_at -> $ts,
                available_at -> $ts,
                leased_until -> Nullable<$ts>,
                leased_by -> Nullable<Text>,
                published_at -> Nullable<$ts>,
                attempts -> Integer,
                last_error -> Nullable<Text>,
                dead_at -> Nullable<$ts>,
            }
        }
    };
}

/// PostgreSQL tables.
#[cfg(feature = "postgres")]
pub(crate) mod pg {
    inbox_tables!(Timestamptz);
}

/// SQLite tables.
#[cfg(feature = "sqlite")]
pub(crate) mod sqlite {
    inbox_tables!(TimestamptzSqlite);
}
