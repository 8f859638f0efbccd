//! The columns operator statements reach, one set for both backends. diesel's tables stop
//! at 16 columns, so these are views of the store's tables with the columns the
//! operator migration added (`replay_count`, `discarded_at`, `replay_seq`), the
//! rebuild's `resolved_at` and the stored `failure_group`, a letter's payload with what a cut body left of it, and
//! the replay sequences' counters.
//!
//! Why not one `table!` per table with diesel's `32-column-tables`: that feature
//! doubles diesel's own compile time for every user of the crate (measured here: 16 s
//! of CPU for diesel with the PostgreSQL and SQLite backends, 32 s with the feature,
//! three interleaved rounds), to remove three view declarations.

diesel::table! {
    use diesel::sql_types::*;
    use crate::schema::sql_types::StoreTime;

    #[sql_name = "inbox_dead_letters"]
    op_dead_letters (id) {
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
        replay_count -> Integer,
        discarded_at -> Nullable<StoreTime>,
        resolved_at -> Nullable<StoreTime>,
        failure_group -> Nullable<Text>,
    }
}

// The same table's payload and what a cut body left of it (length and
// SHA-256): a view of its own, since the one above is at diesel's 16 columns.
diesel::table! {
    use diesel::sql_types::*;

    #[sql_name = "inbox_dead_letters"]
    op_letter_payloads (id) {
        id -> BigInt,
        payload -> Binary,
        payload_length -> Nullable<BigInt>,
        payload_sha256 -> Nullable<Binary>,
    }
}

diesel::table! {
    use diesel::sql_types::*;

    inbox_replay_sequences (message_key) {
        message_key -> Text,
        last_seq -> Integer,
    }
}

diesel::table! {
    use diesel::sql_types::*;
    use crate::schema::sql_types::StoreTime;

    inbox_canary (run_id, seq) {
        run_id -> Text,
        seq -> Integer,
        sent_at -> StoreTime,
        arrived_at -> StoreTime,
        arrivals -> Integer,
    }
}

diesel::table! {
    use diesel::sql_types::*;
    use crate::schema::sql_types::StoreTime;

    #[sql_name = "outbox_messages"]
    op_outbox (id) {
        id -> BigInt,
        message_key -> Text,
        exchange -> Text,
        routing_key -> Text,
        message_type -> Text,
        tenant -> Nullable<Text>,
        payload -> Binary,
        headers -> Text,
        created_at -> StoreTime,
        available_at -> StoreTime,
        published_at -> Nullable<StoreTime>,
        attempts -> Integer,
        dead_at -> Nullable<StoreTime>,
        replay_seq -> Integer,
    }
}
