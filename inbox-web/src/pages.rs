//! The pages (`GET`): each an HTML page, or its JSON document with `Accept:
//! application/json`.

use axum::extract::{Path, Query};
use axum::http::StatusCode;
use axum::response::Response;
use axum::Extension;
use chrono::{DateTime, Utc};
use inbox_core::DeadLetterReason;
use inbox_diesel::operator::{
    json, ActivityQuery, Count, DeadLetterFilter, LetterStatus, OperatorConnection,
};
use inbox_diesel::ClaimStatus;
use maud::{html, Markup};
use serde::Deserialize;
use serde_json::{json as doc, Value};

use crate::view::{self, first_line, text, time, time_or_dash};
use crate::{answer, blocking, problem, Ctx, Shared};

/// The most letters one page lists.
pub(crate) const MAX_PAGE: usize = 200;
/// Letters a page lists by default.
const DEFAULT_PAGE: usize = 50;
/// Dead outbox rows the outbox page lists.
const OUTBOX_ROWS: usize = 200;
/// The failure groups `/failures` lists (the largest).
const FAILURE_GROUPS_SHOWN: usize = 200;
/// Letters of the same key a letter's page lists as its history.
const HISTORY: usize = 50;

fn bad_request(ctx: &Ctx, message: String) -> Response {
    problem(ctx, StatusCode::BAD_REQUEST, &message)
}

fn store_failed(ctx: &Ctx, message: &str) -> Response {
    problem(
        ctx,
        StatusCode::SERVICE_UNAVAILABLE,
        &format!("the store failed: {message}"),
    )
}

/// `/`: per consumer group its processed and dead-lettered messages over the last
/// hour and day, its retries and whether it is halted; the outbox; a chart of the
/// last day. Every figure is read by an index ([`Operator::overview`](inbox_diesel::operator::Operator::overview)).
pub(crate) async fn overview<C: OperatorConnection>(
    state: Shared<C>,
    Extension(ctx): Extension<Ctx>,
) -> Response {
    let o = match blocking(&state.0, |op| op.overview(&ActivityQuery::default())).await {
        Ok(o) => o,
        Err(e) => return store_failed(&ctx, &e),
    };
    answer(&ctx, StatusCode::OK, json::overview(&o), || {
        let base = &ctx.base;
        let count = |c: Count| {
            if c.at_least {
                format!("{}+", c.count)
            } else {
                c.count.to_string()
            }
        };
        let letters_day: u64 = o
            .groups
            .iter()
            .map(|g| g.dead_lettered_last_day.count)
            .sum();
        let content = html! {
            h1 { "Overview" }
            p.muted { "as of " (time(o.at)) }
            div.cards {
                div.card { "dead-lettered, last day" b #letters-day { (letters_day) } }
                div.card { "halted groups" b { (o.halted.len()) } }
                div.card { "outbox backlog" b #outbox-backlog { (o.outbox_backlog) } }
                div.card { "oldest unpublished"
                    b { (o.oldest_unpublished_age_seconds.map_or_else(|| "-".to_owned(), |s| format!("{s:.1} s"))) } }
                div.card { "dead outbox rows" b { (o.dead_outbox_rows) } }
            }
            h2 { "Consumer groups" }
            table #groups {
                tr { th { "group" } th { "state" } th { "processed, hour" } th { "processed, day" }
                     th { "dead-lettered, hour" } th { "dead-lettered, day" } th { "waiting for a retry" } th { "retries due" } }
                @for g in &o.groups {
                    tr {
                        td { a href={ (base) "/letters?consumer_group=" (enc(&g.consumer_group)) } { (g.consumer_group) } }
                        td { @if g.halted { a.err href={ (base) "/halts" } { "halted" } } @else { span.ok { "running" } } }
                        td.num { (count(g.processed_last_hour)) } td.num { (count(g.processed_last_day)) }
                        td.num { (count(g.dead_lettered_last_hour)) } td.num { (count(g.dead_lettered_last_day)) }
                        td.num { (g.retries_waiting) } td.num { (g.retries_due) }
                    }
                }
            }
            @if o.groups.is_empty() { p { "No consumer group has claims or dead letters yet." } }
            p.muted { "A count with + reached its read's cap: the true number is that or more. Processed counts the claims that reached done and are not purged yet." }
            h2 { "Last day, per hour, all groups" }
            (view::chart(&chart_points(&o.activity)))
        };
        view::page(&ctx, "Overview", content)
    })
}

/// The activity's buckets summed over the groups.
fn chart_points(a: &inbox_diesel::operator::Activity) -> Vec<view::ChartPoint> {
    let mut points: Vec<view::ChartPoint> = Vec::new();
    for g in &a.groups {
        for (i, b) in g.buckets.iter().enumerate() {
            if points.len() <= i {
                points.push(view::ChartPoint {
                    start: b.start,
                    processed: 0,
                    dead_lettered: 0,
                    at_least: false,
                });
            }
            let p = &mut points[i];
            p.processed += b.processed.count;
            p.dead_lettered += b.dead_lettered.count;
            p.at_least |= b.processed.at_least || b.dead_lettered.at_least;
        }
    }
    points
}

/// URL-encodes a query value.
pub(crate) fn enc(value: &str) -> String {
    serde_urlencoded::to_string([("", value)])
        .map(|s| s.trim_start_matches('=').to_owned())
        .unwrap_or_default()
}

/// The filter of `/letters` and `/failures`, as given.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct LetterQuery {
    consumer_group: Option<String>,
    reason: Option<String>,
    message_type: Option<String>,
    failure_group: Option<String>,
    key: Option<String>,
    since: Option<String>,
    until: Option<String>,
    status: Option<String>,
    offset: Option<String>,
    limit: Option<String>,
}

fn given(v: &Option<String>) -> Option<&str> {
    v.as_deref().map(str::trim).filter(|s| !s.is_empty())
}

fn parse_time(name: &str, v: &Option<String>) -> Result<Option<DateTime<Utc>>, String> {
    given(v)
        .map(|t| {
            DateTime::parse_from_rfc3339(t)
                .map(|t| t.with_timezone(&Utc))
                .map_err(|_| {
                    format!("{name}: expected an RFC 3339 time (2026-12-01T10:00:00Z), found {t:?}")
                })
        })
        .transpose()
}

/// Checks a failure group's fingerprint: 16 lower-case hex digits.
pub(crate) fn fingerprint(fp: &str) -> Result<&str, String> {
    if fp.len() == 16 && fp.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        Ok(fp)
    } else {
        Err(format!(
            "a failure group is 16 lower-case hex digits, found {fp:?}"
        ))
    }
}

impl LetterQuery {
    pub(crate) fn filter(&self) -> Result<DeadLetterFilter, String> {
        let mut f = DeadLetterFilter::default();
        if let Some(g) = given(&self.consumer_group) {
            f = f.consumer_group(g);
        }
        if let Some(r) = given(&self.reason) {
            f = f.reason(
                DeadLetterReason::parse(r).ok_or_else(|| format!("reason: no reason {r:?}"))?,
            );
        }
        if let Some(t) = given(&self.message_type) {
            f = f.message_type(t);
        }
        if let Some(fp) = given(&self.failure_group) {
            f = f.failure_group(fingerprint(fp)?);
        }
        if let Some(k) = given(&self.key) {
            f = f.message_key(k);
        }
        if let Some(at) = parse_time("since", &self.since)? {
            f = f.since(at);
        }
        if let Some(at) = parse_time("until", &self.until)? {
            f = f.until(at);
        }
        match given(&self.status) {
            None | Some("active") => {}
            Some(s) => {
                f = f.status(LetterStatus::parse(s).ok_or_else(|| {
                    format!("status: expected pending, replayed, resolved, discarded or active, found {s:?}")
                })?)
            }
        }
        Ok(f)
    }

    fn number(name: &str, v: &Option<String>, default: usize, max: usize) -> Result<usize, String> {
        match given(v) {
            None => Ok(default),
            Some(t) => t
                .parse::<usize>()
                .ok()
                .filter(|n| *n <= max)
                .ok_or_else(|| format!("{name}: expected a number from 0 to {max}, found {t:?}")),
        }
    }

    /// The query string of this filter (without offset and limit).
    fn query_string(&self) -> String {
        let pairs: Vec<(&str, &str)> = [
            ("consumer_group", &self.consumer_group),
            ("reason", &self.reason),
            ("message_type", &self.message_type),
            ("failure_group", &self.failure_group),
            ("key", &self.key),
            ("since", &self.since),
            ("until", &self.until),
            ("status", &self.status),
        ]
        .into_iter()
        .filter_map(|(k, v)| given(v).map(|v| (k, v)))
        .collect();
        serde_urlencoded::to_string(pairs).unwrap_or_default()
    }
}

/// `/failures`: failure groups of the letters matching the filter, largest first.
pub(crate) async fn failures<C: OperatorConnection>(
    state: Shared<C>,
    Extension(ctx): Extension<Ctx>,
    Query(q): Query<LetterQuery>,
) -> Response {
    let filter = match q.filter() {
        Ok(f) => f,
        Err(e) => return bad_request(&ctx, e),
    };
    let groups = match blocking(&state.0, move |op| {
        op.top_failure_groups(&filter, FAILURE_GROUPS_SHOWN)
    })
    .await
    {
        Ok(g) => g,
        Err(e) => return store_failed(&ctx, &e),
    };
    let rows: Vec<Value> = groups.iter().map(json::failure_group).collect();
    answer(
        &ctx,
        StatusCode::OK,
        doc!({ "failure_groups": rows }),
        || {
            let base = &ctx.base;
            let content = html! {
                h1 { "Failure groups" }
                p.muted { "Dead letters that failed the same way (reason, message type and error, numbers and ids masked). Default: every letter not discarded." }
                (filter_form(&ctx, "/failures", &q))
                table #failure-groups {
                    tr { th { "failure group" } th { "letters" } th { "reason" } th { "message type" } th { "error" }
                         th { "consumer groups" } th { "first seen" } th { "last seen" } th { "actions" } }
                    @for g in &groups {
                        tr {
                            td { a.fg href={ (base) "/letters?failure_group=" (g.fingerprint) } { code { (g.fingerprint) } } }
                            td.num { (g.count) }
                            td { (g.reason.as_str()) }
                            td { (text(&g.message_type)) }
                            td { code { (text(&g.signature)) }
                             @if let Some(e) = &g.sample_error { br; span.muted { "e.g. " (first_line(Some(e))) } } }
                            td { @for (i, cg) in g.consumer_groups.iter().enumerate() { @if i > 0 { ", " } (cg) } }
                            td { (time(g.first_seen)) }
                            td { (time(g.last_seen)) }
                            td {
                                @if !ctx.read_only {
                                    @if g.replayable {
                                        form.inline method="post" action={ (base) "/failures/" (g.fingerprint) "/replay" } {
                                            (view::csrf_field(&ctx))
                                            input type="hidden" name="consumer_group" value=(q.consumer_group.clone().unwrap_or_default());
                                            button.primary type="submit" { "Replay all…" }
                                        }
                                        " "
                                    }
                                    form.inline method="post" action={ (base) "/failures/" (g.fingerprint) "/discard" } {
                                        (view::csrf_field(&ctx))
                                        input type="hidden" name="consumer_group" value=(q.consumer_group.clone().unwrap_or_default());
                                        button.danger type="submit" { "Discard all…" }
                                    }
                                }
                            }
                        }
                    }
                }
                @if groups.is_empty() { p { "No dead letters match." } }
                @if groups.len() == FAILURE_GROUPS_SHOWN { p.muted { "The largest " (FAILURE_GROUPS_SHOWN) " failure groups are shown: narrow the filter for the others." } }
            };
            view::page(&ctx, "Failure groups", content)
        },
    )
}

fn filter_form(ctx: &Ctx, path: &str, q: &LetterQuery) -> Markup {
    let v = |o: &Option<String>| o.clone().unwrap_or_default();
    html! {
        form.filters method="get" action={ (ctx.base) (path) } {
            label { "group" input name="consumer_group" value=(v(&q.consumer_group)); }
            label { "reason" input name="reason" value=(v(&q.reason)) placeholder="max_attempts"; }
            label { "failure group" input name="failure_group" value=(v(&q.failure_group)); }
            label { "key" input name="key" value=(v(&q.key)); }
            label { "since" input name="since" value=(v(&q.since)) placeholder="2026-12-01T00:00:00Z"; }
            label { "until" input name="until" value=(v(&q.until)); }
            label { "status" input name="status" value=(v(&q.status)) placeholder="active"; }
            button type="submit" { "Filter" }
        }
    }
}

/// `/letters`: dead letters matching the filter, newest first, paged.
pub(crate) async fn letters<C: OperatorConnection>(
    state: Shared<C>,
    Extension(ctx): Extension<Ctx>,
    Query(q): Query<LetterQuery>,
) -> Response {
    let parsed = q.filter().and_then(|f| {
        Ok((
            f,
            LetterQuery::number("offset", &q.offset, 0, usize::MAX / 2)?,
            LetterQuery::number("limit", &q.limit, DEFAULT_PAGE, MAX_PAGE)?,
        ))
    });
    let (filter, offset, limit) = match parsed {
        Ok(p) => p,
        Err(e) => return bad_request(&ctx, e),
    };
    let letters = match blocking(&state.0, move |op| {
        op.list_dead_letters(&filter, offset, limit)
    })
    .await
    {
        Ok(l) => l,
        Err(e) => return store_failed(&ctx, &e),
    };
    let rows: Vec<Value> = letters.iter().map(json::dead_letter).collect();
    let body = doc!({ "dead_letters": rows, "offset": offset, "limit": limit });
    answer(&ctx, StatusCode::OK, body, || {
        let base = &ctx.base;
        let qs = q.query_string();
        let content = html! {
            h1 { "Dead letters" }
            (filter_form(&ctx, "/letters", &q))
            table #letters {
                tr { th { "id" } th { "group" } th { "key" } th { "type" } th { "reason" } th { "attempts" }
                     th { "status" } th { "replays" } th { "dead-lettered" } th { "last error" } }
                @for e in &letters {
                    tr {
                        td { a.letter href={ (base) "/letters/" (e.id) } { (e.id) } }
                        td { (e.consumer_group) }
                        td { code { (text(&e.message_key)) } }
                        td { (text(&e.message_type)) }
                        td { (e.reason.as_str()) }
                        td.num { (e.attempts) }
                        td { (e.status.as_str()) }
                        td.num { (e.replay_count) }
                        td { (time(e.dead_lettered_at)) }
                        td { (first_line(e.last_error.as_deref())) }
                    }
                }
            }
            @if letters.is_empty() { p { "No dead letters match." } }
            div.pager {
                @if offset > 0 {
                    a href={ (base) "/letters?" (qs) "&offset=" (offset.saturating_sub(limit)) "&limit=" (limit) } { "← newer" }
                }
                @if letters.len() == limit {
                    a href={ (base) "/letters?" (qs) "&offset=" (offset + limit) "&limit=" (limit) } { "older →" }
                }
            }
        };
        view::page(&ctx, "Dead letters", content)
    })
}

/// `/letters/{id}`: a letter in full, and the letters of its key in its group.
pub(crate) async fn letter<C: OperatorConnection>(
    state: Shared<C>,
    Extension(ctx): Extension<Ctx>,
    Path(id): Path<String>,
) -> Response {
    let Ok(id) = id.parse::<i64>() else {
        return bad_request(
            &ctx,
            format!("a dead letter's id is a number, found {id:?}"),
        );
    };
    let found = blocking(&state.0, move |op| {
        let Some(d) = op.dead_letter_details(id)? else {
            return Ok(None);
        };
        // Every letter of the key in the group: the active ones, then the discarded.
        let same_key = DeadLetterFilter::default()
            .consumer_group(d.entry.consumer_group.clone())
            .message_key(d.entry.message_key.clone());
        let mut history = op.list_dead_letters(&same_key, 0, HISTORY)?;
        history.extend(op.list_dead_letters(
            &same_key.status(LetterStatus::Discarded),
            0,
            HISTORY,
        )?);
        history.sort_by_key(|h| std::cmp::Reverse(h.id));
        history.truncate(HISTORY);
        Ok(Some((d, history)))
    })
    .await;
    let (d, history) = match found {
        Ok(Some(found)) => found,
        Ok(None) => return problem(&ctx, StatusCode::NOT_FOUND, &format!("no dead letter {id}")),
        Err(e) => return store_failed(&ctx, &e),
    };
    let mut body = json::dead_letter_details(&d);
    if let Value::Object(map) = &mut body {
        map.insert(
            "history".into(),
            Value::Array(history.iter().map(json::dead_letter).collect()),
        );
    }
    answer(&ctx, StatusCode::OK, body, || {
        let base = &ctx.base;
        let e = &d.entry;
        let content = html! {
            h1 { "Dead letter " (e.id) }
            dl #letter {
                dt { "consumer group" } dd { (e.consumer_group) }
                dt { "message key" } dd { code { (text(&e.message_key)) } }
                dt { "message type" } dd { (text(&e.message_type)) }
                dt { "tenant" } dd { (e.tenant.as_deref().unwrap_or("-")) }
                dt { "reason" } dd { (e.reason.as_str()) }
                dt { "status" } dd #status { (e.status.as_str()) }
                dt { "attempts" } dd { (e.attempts) }
                dt { "dead-lettered" } dd { (time(e.dead_lettered_at)) }
                dt { "first / last failure" } dd { (time(d.first_failure_at)) " / " (time(d.last_failure_at)) }
                dt { "replays" } dd { (e.replay_count) @if let Some(at) = e.replayed_at { ", last " (time(at)) } }
                @if let Some(n) = e.delivered_by_replay { dt { "delivered by replay" } dd { (n) } }
                dt { "claim" } dd { (d.claim_status.map_or("none", |s| s.as_str())) }
                dt { "failure group" } dd { a href={ (base) "/letters?failure_group=" (e.failure_group) } { code { (e.failure_group) } } }
                dt { "replayable" } dd { @match d.replay_refusal { None => "yes", Some(why) => { "no: " (why) } } }
            }
            h2 { "Last error" }
            pre #last-error { (text(e.last_error.as_deref().unwrap_or("-"))) }
            @if !ctx.read_only {
                p {
                    @if d.replay_refusal.is_none() {
                        form.inline method="post" action={ (base) "/letters/" (e.id) "/replay" } {
                            (view::csrf_field(&ctx))
                            button.primary #replay type="submit" { "Replay…" }
                        }
                        " "
                    }
                    form.inline method="post" action={ (base) "/letters/" (e.id) "/discard" } {
                        (view::csrf_field(&ctx))
                        button.danger #discard type="submit" { "Discard…" }
                    }
                }
            }
            h2 { "Payload" }
            @if let Some(cut) = d.payload_cut { p.err { "The body was cut: only the first bytes of " (cut.length) " were kept." } }
            (view::payload(&d.payload))
            h2 { "Headers" }
            table #headers {
                tr { th { "name" } th { "value" } }
                @for (k, v) in d.headers.iter().take(200) { tr { td { code { (text(k)) } } td { code { (text(v)) } } } }
            }
            @if d.headers.len() > 200 { p.muted { "the first 200 of " (d.headers.len()) " headers are shown" } }
            h2 { "Replay history of this key in this group" }
            table #history {
                tr { th { "id" } th { "status" } th { "replays" } th { "delivered by replay" } th { "dead-lettered" } th { "error" } }
                @for h in &history {
                    tr {
                        td { a href={ (base) "/letters/" (h.id) } { (h.id) } }
                        td { (h.status.as_str()) }
                        td.num { (h.replay_count) }
                        td { (h.delivered_by_replay.map_or_else(|| "-".to_owned(), |n| n.to_string())) }
                        td { (time(h.dead_lettered_at)) }
                        td { (first_line(h.last_error.as_deref())) }
                    }
                }
            }
            p { a href={ (base) "/claims?key=" (enc(&e.message_key)) } { "claims of this key" } }
        };
        view::page(&ctx, &format!("Dead letter {}", e.id), content)
    })
}

fn halt_table(ctx: &Ctx, halted: &[inbox_diesel::operator::HaltedGroup]) -> Markup {
    html! {
        table #halts {
            tr { th { "group" } th { "halted at" } th { "key" } th { "cause" } th { "action" } }
            @for h in halted {
                tr {
                    td { (h.consumer_group) }
                    td { (time(h.halted_at)) }
                    td { code { (text(&h.message_key)) } }
                    td { (text(&h.detail)) }
                    td {
                        @if !ctx.read_only {
                            form.inline method="post" action={ (ctx.base) "/halts/resume" } {
                                (view::csrf_field(ctx))
                                input type="hidden" name="group" value=(h.consumer_group);
                                button.primary type="submit" { "Resume…" }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// `/halts`: halted consumer groups with their cause.
pub(crate) async fn halts<C: OperatorConnection>(
    state: Shared<C>,
    Extension(ctx): Extension<Ctx>,
) -> Response {
    let halted = match blocking(&state.0, |op| op.list_halted_groups()).await {
        Ok(h) => h,
        Err(e) => return store_failed(&ctx, &e),
    };
    let rows: Vec<Value> = halted.iter().map(json::halted_group).collect();
    answer(&ctx, StatusCode::OK, doc!({ "halted": rows }), || {
        let content = html! {
            h1 { "Halted consumer groups" }
            p.muted { "A group halts when a claim breaks the store's invariant; it resumes at its next halt poll once resumed here." }
            (halt_table(&ctx, &halted))
            @if halted.is_empty() { p { "No group is halted." } }
        };
        view::page(&ctx, "Halted groups", content)
    })
}

/// `/outbox`: the outbox's backlog and its dead rows.
pub(crate) async fn outbox<C: OperatorConnection>(
    state: Shared<C>,
    Extension(ctx): Extension<Ctx>,
) -> Response {
    let read = blocking(&state.0, |op| {
        Ok((
            op.store().dead_outbox_rows(OUTBOX_ROWS)?,
            op.outbox_summary()?,
        ))
    })
    .await;
    let (dead, stats) = match read {
        Ok(r) => r,
        Err(e) => return store_failed(&ctx, &e),
    };
    let rows: Vec<Value> = dead.iter().map(json::dead_outbox_row).collect();
    let body = doc!({
        "backlog": stats.backlog,
        "oldest_unpublished_age_seconds": stats.oldest_unpublished_age_seconds,
        "dead": stats.dead,
        "dead_outbox_rows": rows,
    });
    answer(&ctx, StatusCode::OK, body, || {
        let content = html! {
            h1 { "Outbox" }
            div.cards {
                div.card { "unpublished" b { (stats.backlog) } }
                div.card { "oldest unpublished" b { (stats.oldest_unpublished_age_seconds.map_or_else(|| "-".to_owned(), |s| format!("{s:.1} s"))) } }
                div.card { "dead rows" b { (stats.dead) } }
            }
            h2 { "Dead rows" }
            p.muted { "A row whose last publish attempt failed: kept, never published again until revived. It holds up no other row." }
            table #dead-outbox {
                tr { th { "id" } th { "key" } th { "exchange" } th { "routing key" } th { "type" } th { "attempts" } th { "last error" } th { "dead since" } th { "action" } }
                @for r in &dead {
                    tr {
                        td { (r.id) } td { code { (text(&r.message_key)) } } td { (text(&r.exchange)) }
                        td { (text(&r.routing_key)) } td { (text(&r.message_type)) } td.num { (r.attempts) }
                        td { (first_line(r.last_error.as_deref())) } td { (time(r.dead_at)) }
                        td {
                            @if !ctx.read_only {
                                form.inline method="post" action={ (ctx.base) "/outbox/revive" } {
                                    (view::csrf_field(&ctx))
                                    input type="hidden" name="id" value=(r.id);
                                    button.primary type="submit" { "Revive…" }
                                }
                            }
                        }
                    }
                }
            }
            @if dead.is_empty() { p { "No dead outbox row." } }
            @if dead.len() == OUTBOX_ROWS { p.muted { "the oldest " (OUTBOX_ROWS) " dead rows are shown" } }
        };
        view::page(&ctx, "Outbox", content)
    })
}

/// The query of `/claims`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct ClaimQuery {
    key: Option<String>,
}

/// `/claims?key=...`: every claim of a message key, one per consumer group.
pub(crate) async fn claims<C: OperatorConnection>(
    state: Shared<C>,
    Extension(ctx): Extension<Ctx>,
    Query(q): Query<ClaimQuery>,
) -> Response {
    let key = given(&q.key).map(str::to_owned);
    let claims = match &key {
        None => Vec::new(),
        Some(k) => {
            let k = k.clone();
            match blocking(&state.0, move |op| op.claims_for_key(&k)).await {
                Ok(c) => c,
                Err(e) => return store_failed(&ctx, &e),
            }
        }
    };
    let rows: Vec<Value> = claims.iter().map(json::claim).collect();
    answer(&ctx, StatusCode::OK, doc!({ "claims": rows }), || {
        let content = html! {
            h1 { "Claims" }
            form.filters method="get" action={ (ctx.base) "/claims" } {
                label { "message key" input name="key" value=(key.clone().unwrap_or_default()); }
                button type="submit" { "Show" }
            }
            @if key.is_some() {
                table #claims {
                    tr { th { "group" } th { "type" } th { "status" } th { "attempts" } th { "starts" } th { "next attempt" } th { "first seen" } th { "updated" } th { "last error" } }
                    @for c in &claims {
                        tr {
                            td { (c.group) } td { (text(&c.message_type)) } td { (c.status.as_str()) }
                            td.num { (c.attempts) } td.num { (c.starts) }
                            td { @if c.status == ClaimStatus::Failed { (time_or_dash(c.next_attempt_at)) } @else { "-" } }
                            td { (time(c.first_seen_at)) } td { (time(c.updated_at)) }
                            td { @if c.status == ClaimStatus::Done { @if let Some(e) = &c.last_error { span.muted { "before it succeeded: " (first_line(Some(e))) } } } @else { (first_line(c.last_error.as_deref())) } }
                        }
                    }
                }
                @if claims.is_empty() { p { "No claim of this key." } }
            }
        };
        view::page(&ctx, "Claims", content)
    })
}

/// How many reports `/rebuilds` lists.
const REPORTS: usize = 50;

/// The query of `/rebuilds`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct ReportQuery {
    projection: Option<String>,
}

/// `/rebuilds`: the last rebuild and audit runs with their reports and drift.
pub(crate) async fn rebuilds<C: OperatorConnection>(
    state: Shared<C>,
    Extension(ctx): Extension<Ctx>,
    Query(q): Query<ReportQuery>,
) -> Response {
    let projection = given(&q.projection).map(str::to_owned);
    let p = projection.clone();
    let reports = match blocking(&state.0, move |op| {
        op.rebuild_reports(p.as_deref(), REPORTS)
    })
    .await
    {
        Ok(r) => r,
        Err(e) => return store_failed(&ctx, &e),
    };
    let rows = serde_json::to_value(&reports).unwrap_or(Value::Null);
    answer(
        &ctx,
        StatusCode::OK,
        doc!({ "rebuild_reports": rows }),
        || {
            let content = html! {
                h1 { "Rebuilds and audits" }
                p.muted { "The newest " (REPORTS) " runs" @if let Some(p) = &projection { " of " (p) } ", newest first. A rebuild recomputes a window of a projection from its source of truth; an audit compares without writing." }
                table #reports {
                    tr { th { "finished" } th { "projection" } th { "kind" } th { "outcome" } th { "partitions" } th { "rows checked" }
                         th { "rows differing" } th { "rows changed" } th { "events covered" } th { "letters resolved" } th { "largest ratio" } th { "ms" } th { "error or drift" } }
                    @for r in &reports {
                        tr {
                            td { (time(r.finished_at)) }
                            td { a href={ (ctx.base) "/rebuilds?projection=" (enc(&r.projection)) } { (r.projection) } }
                            td { (serde_json::to_value(r.kind).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default()) }
                            td { @let ok = r.error.is_none(); span.(if ok { "ok" } else { "err" }) { (serde_json::to_value(r.outcome).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default()) } }
                            td.num { (r.partitions) } td.num { (r.rows_checked) } td.num { (r.rows_differing) } td.num { (r.rows_changed) }
                            td.num { (r.events_covered) } td.num { (r.dead_letters_resolved) }
                            td.num { (r.largest_ratio.map_or_else(|| "-".to_owned(), |x| format!("{x:.3}"))) }
                            td.num { (r.duration_ms) }
                            td {
                                @if let Some(e) = &r.error { span.err { (first_line(Some(e))) } }
                                @else if r.rows_differing > 0 { code { (text(&r.drift_sample.to_string())) } }
                            }
                        }
                    }
                }
                @if reports.is_empty() { p { "No rebuild or audit has run yet (they are recorded by the store when they finish)." } }
            };
            view::page(&ctx, "Rebuilds", content)
        },
    )
}

/// `/login`: the token form (token mode).
pub(crate) async fn login_form<C: OperatorConnection>(
    state: Shared<C>,
    Extension(ctx): Extension<Ctx>,
) -> Response {
    if !state.keys.token_required() {
        return problem(
            &ctx,
            StatusCode::NOT_FOUND,
            "this console has no login: its host's auth layer admits visitors",
        );
    }
    login_page(&ctx, StatusCode::OK, None)
}

pub(crate) fn login_page(ctx: &Ctx, status: StatusCode, error: Option<&str>) -> Response {
    answer(ctx, status, doc!({ "error": error }), || {
        view::page(
            ctx,
            "Log in",
            html! {
                h1 { "Log in" }
                @if let Some(e) = error { (view::notice(false, e)) }
                form method="post" action={ (ctx.base) "/login" } {
                    label { "token " input #token type="password" name="token" autocomplete="current-password"; }
                    " "
                    button.primary #login type="submit" { "Log in" }
                }
            },
        )
    })
}
