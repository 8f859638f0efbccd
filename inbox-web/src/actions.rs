//! The actions (`POST`): replay and discard a letter or a failure group, resume a
//! halted group, revive a dead outbox row; log in and out.
//!
//! The gate has checked the origin, the CSRF token and read-only mode before any of
//! these runs. Without `confirm=yes` an action changes nothing and answers with what it
//! would touch (a confirmation page, or `{"confirm": ...}`); with it, the operator API
//! decides, by its guarded writes, and the answer says what happened. Each change is
//! logged at `info` on the target `inbox_web::audit`, with who asked.
//!
//! Two actions on one letter at once (two clicks, two operators, the CLI beside the
//! console) meet in the operator API's guards: one replay enqueues a copy, the other
//! finds the letter replayed (`claim_not_dead`); a replay and a discard go in the order
//! they take the letter. The console adds no rule and no read that decides.

use axum::body::Bytes;
use axum::extract::Path;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::Extension;
use inbox_diesel::operator::{
    json, DeadLetterFilter, DiscardOutcome, LetterStatus, OperatorConnection, ReplayOutcome,
};
use maud::html;
use serde::Deserialize;
use serde_json::json as doc;

use crate::pages::{fingerprint, login_page};
use crate::session::{self, Kind};
use crate::view;
use crate::{answer, blocking, problem, Ctx, Shared};

/// The form of every action.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct ActionForm {
    confirm: Option<String>,
    group: Option<String>,
    id: Option<String>,
    consumer_group: Option<String>,
}

/// A form body (`application/x-www-form-urlencoded`), or a 400 `{"error"}` saying
/// why not (a repeated field, a value that is not text).
fn parse_form<T: serde::de::DeserializeOwned>(ctx: &Ctx, body: &[u8]) -> Result<T, Box<Response>> {
    serde_urlencoded::from_bytes(body).map_err(|e| {
        Box::new(problem(
            ctx,
            StatusCode::BAD_REQUEST,
            &format!("the form does not parse (an urlencoded form, each field once): {e}"),
        ))
    })
}

impl ActionForm {
    fn confirmed(&self) -> bool {
        self.confirm.as_deref() == Some("yes")
    }
}

fn store_failed(ctx: &Ctx, message: &str) -> Response {
    problem(
        ctx,
        StatusCode::SERVICE_UNAVAILABLE,
        &format!("the store failed: {message}"),
    )
}

/// The confirmation of an action: what it touches, and a form that repeats it with
/// `confirm=yes`.
fn confirmation(
    ctx: &Ctx,
    action: &str,
    what: String,
    touches: u64,
    fields: &[(&str, &str)],
) -> Response {
    let doc = doc!({ "confirm": { "action": action, "touches": touches, "what": what } });
    answer(ctx, StatusCode::OK, doc, || {
        view::page(
            ctx,
            "Confirm",
            html! {
                h1 { "Confirm" }
                p #confirm-what { (what) }
                form method="post" action={ (ctx.base) (action) } {
                    (view::csrf_field(ctx))
                    input type="hidden" name="confirm" value="yes";
                    @for (k, v) in fields { input type="hidden" name=(k) value=(v); }
                    button.primary #confirm type="submit" { "Confirm" }
                    " "
                    a href=(crate::home(ctx)) { "Cancel" }
                }
            },
        )
    })
}

/// The result of an action: a notice and a link back.
fn result(
    ctx: &Ctx,
    status: StatusCode,
    doc: serde_json::Value,
    message: String,
    back: String,
) -> Response {
    answer(ctx, status, doc, || {
        view::page(
            ctx,
            "Result",
            html! {
                h1 { "Result" }
                (view::notice(status.is_success(), &message))
                p { a #back href=(back) { "back" } }
            },
        )
    })
}

fn letter_id(id: &str) -> Result<i64, String> {
    id.parse::<i64>()
        .map_err(|_| format!("a dead letter's id is a number, found {id:?}"))
}

/// `POST /letters/{id}/replay`.
pub(crate) async fn replay_letter<C: OperatorConnection>(
    state: Shared<C>,
    Extension(ctx): Extension<Ctx>,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    let form: ActionForm = match parse_form(&ctx, &body) {
        Ok(f) => f,
        Err(r) => return *r,
    };
    let id = match letter_id(&id) {
        Ok(id) => id,
        Err(e) => return problem(&ctx, StatusCode::BAD_REQUEST, &e),
    };
    let back = format!("{}/letters/{id}", ctx.base);
    if !form.confirmed() {
        return match blocking(&state.0, move |op| op.dead_letter_details(id)).await {
            Ok(Some(d)) => confirmation(
                &ctx,
                &format!("/letters/{id}/replay"),
                format!(
                    "Replay dead letter {id} (key {}) to consumer group {} alone? One copy is enqueued on the outbox; the service's relay publishes it.",
                    d.entry.message_key, d.entry.consumer_group
                ),
                1,
                &[],
            ),
            Ok(None) => problem(&ctx, StatusCode::NOT_FOUND, &format!("no dead letter {id}")),
            Err(e) => store_failed(&ctx, &e),
        };
    }
    let target = state.target.clone();
    let outcome = match blocking(&state.0, move |op| op.replay_dead_letter(id, &target)).await {
        Ok(o) => o,
        Err(e) => return store_failed(&ctx, &e),
    };
    let doc = json::replay_outcome(id, &outcome);
    let name = doc["outcome"].as_str().unwrap_or_default().to_owned();
    tracing::info!(target: "inbox_web::audit", who = %ctx.who, action = "replay", letter = id, outcome = %name, "console action");
    let (status, message) = match &outcome {
        ReplayOutcome::Replayed { sequence, outbox_id } => (
            StatusCode::OK,
            format!("Dead letter {id} replayed: replay {sequence}, outbox row {outbox_id}."),
        ),
        ReplayOutcome::Refused { reason, advice } => (
            StatusCode::CONFLICT,
            format!("Refused: dead letter {id} ({reason}) is not replayable: {advice}"),
        ),
        ReplayOutcome::ClaimNotDead { status } => (
            StatusCode::CONFLICT,
            format!(
                "Refused: nothing enqueued. Dead letter {id}'s claim is {}, not dead: it was replayed already.",
                status.map_or("none", |s| s.as_str())
            ),
        ),
        ReplayOutcome::Discarded => (
            StatusCode::CONFLICT,
            format!("Refused: dead letter {id} is discarded."),
        ),
        _ => (StatusCode::NOT_FOUND, format!("No dead letter {id}.")),
    };
    result(&ctx, status, doc, message, back)
}

/// `POST /letters/{id}/discard`.
pub(crate) async fn discard_letter<C: OperatorConnection>(
    state: Shared<C>,
    Extension(ctx): Extension<Ctx>,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    let form: ActionForm = match parse_form(&ctx, &body) {
        Ok(f) => f,
        Err(r) => return *r,
    };
    let id = match letter_id(&id) {
        Ok(id) => id,
        Err(e) => return problem(&ctx, StatusCode::BAD_REQUEST, &e),
    };
    let back = format!("{}/letters/{id}", ctx.base);
    if !form.confirmed() {
        return confirmation(
            &ctx,
            &format!("/letters/{id}/discard"),
            format!(
                "Discard dead letter {id}? It is archived: kept until a purge, never replayed."
            ),
            1,
            &[],
        );
    }
    let outcome = match blocking(&state.0, move |op| op.discard_dead_letter(id)).await {
        Ok(o) => o,
        Err(e) => return store_failed(&ctx, &e),
    };
    let doc = json::discard_outcome(id, outcome);
    let name = doc["outcome"].as_str().unwrap_or_default().to_owned();
    tracing::info!(target: "inbox_web::audit", who = %ctx.who, action = "discard", letter = id, outcome = %name, "console action");
    let (status, message) = match outcome {
        DiscardOutcome::Discarded => (StatusCode::OK, format!("Dead letter {id} discarded.")),
        DiscardOutcome::AlreadyDiscarded => (
            StatusCode::CONFLICT,
            format!("Refused: dead letter {id} was discarded already."),
        ),
        _ => (StatusCode::NOT_FOUND, format!("No dead letter {id}.")),
    };
    result(&ctx, status, doc, message, back)
}

/// The pending letters of a failure group (in one consumer group when given).
fn group_filter(fp: &str, form: &ActionForm) -> DeadLetterFilter {
    let mut f = DeadLetterFilter::default()
        .failure_group(fp)
        .status(LetterStatus::Pending);
    if let Some(g) = form.consumer_group.as_deref().filter(|g| !g.is_empty()) {
        f = f.consumer_group(g);
    }
    f
}

/// The confirmation of a bulk action: how many letters it touches, bounded.
async fn bulk_confirmation<C: OperatorConnection>(
    state: &Shared<C>,
    ctx: &Ctx,
    fp: &str,
    form: &ActionForm,
    verb: &str,
) -> Response {
    let filter = group_filter(fp, form);
    let max = state.max_bulk;
    let n = match blocking(&state.0, move |op| {
        Ok(op.list_dead_letters(&filter, 0, max + 1)?.len())
    })
    .await
    {
        Ok(n) => n,
        Err(e) => return store_failed(ctx, &e),
    };
    let scope = match form.consumer_group.as_deref().filter(|g| !g.is_empty()) {
        Some(g) => format!("in consumer group {g}"),
        None => "in every consumer group".to_owned(),
    };
    let what = if n > max {
        format!(
            "{verb} the pending dead letters of failure group {fp} {scope}? More than {max} match: this click {} the first {max}, the next click the rest.",
            if verb == "Replay" { "replays" } else { "discards" }
        )
    } else {
        format!("{verb} the {n} pending dead letters of failure group {fp} {scope}?")
    };
    let group = form.consumer_group.clone().unwrap_or_default();
    confirmation(
        ctx,
        &format!("/failures/{fp}/{}", verb.to_lowercase()),
        what,
        n.min(max) as u64,
        &[("consumer_group", group.as_str())],
    )
}

/// A bulk action's form and checked fingerprint once confirmed; otherwise the answer
/// to give (a bad form or fingerprint, or the confirmation page).
async fn confirmed_bulk<C: OperatorConnection>(
    state: &Shared<C>,
    ctx: &Ctx,
    fp: &str,
    body: &[u8],
    verb: &str,
) -> Result<(String, ActionForm), Box<Response>> {
    let form: ActionForm = parse_form(ctx, body)?;
    let fp = fingerprint(fp)
        .map_err(|e| Box::new(problem(ctx, StatusCode::BAD_REQUEST, &e)))?
        .to_owned();
    if !form.confirmed() {
        return Err(Box::new(
            bulk_confirmation(state, ctx, &fp, &form, verb).await,
        ));
    }
    Ok((fp, form))
}

/// `POST /failures/{fingerprint}/replay`: replays the group's pending letters, at most
/// `max_bulk` of them.
pub(crate) async fn replay_group<C: OperatorConnection>(
    state: Shared<C>,
    Extension(ctx): Extension<Ctx>,
    Path(fp): Path<String>,
    body: Bytes,
) -> Response {
    let (fp, form) = match confirmed_bulk(&state, &ctx, &fp, &body, "Replay").await {
        Ok(asked) => asked,
        Err(answer) => return *answer,
    };
    let filter = group_filter(&fp, &form);
    let (target, max) = (state.target.clone(), state.max_bulk);
    let report = match blocking(&state.0, move |op| {
        op.replay_dead_letters(&filter, Some(max), &target)
    })
    .await
    {
        Ok(r) => r,
        Err(e) => return store_failed(&ctx, &e),
    };
    tracing::info!(target: "inbox_web::audit", who = %ctx.who, action = "replay_failure_group", failure_group = %fp,
        matched = report.matched, replayed = report.affected, refused = report.refused, skipped = report.skipped, "console action");
    let mut doc = json::bulk_replay(&report);
    doc["limit"] = doc!(max);
    result(
        &ctx,
        StatusCode::OK,
        doc,
        format!(
            "Replayed {} of {} dead letters of failure group {fp} ({} refused for their reason, {} skipped: no longer dead).",
            report.affected, report.matched, report.refused, report.skipped
        ),
        format!("{}/letters?failure_group={fp}&status=active", ctx.base),
    )
}

/// `POST /failures/{fingerprint}/discard`: discards the group's pending letters, at
/// most `max_bulk` of them.
pub(crate) async fn discard_group<C: OperatorConnection>(
    state: Shared<C>,
    Extension(ctx): Extension<Ctx>,
    Path(fp): Path<String>,
    body: Bytes,
) -> Response {
    let (fp, form) = match confirmed_bulk(&state, &ctx, &fp, &body, "Discard").await {
        Ok(asked) => asked,
        Err(answer) => return *answer,
    };
    let filter = group_filter(&fp, &form);
    let max = state.max_bulk;
    let report = match blocking(&state.0, move |op| {
        op.discard_dead_letters(&filter, Some(max))
    })
    .await
    {
        Ok(r) => r,
        Err(e) => return store_failed(&ctx, &e),
    };
    tracing::info!(target: "inbox_web::audit", who = %ctx.who, action = "discard_failure_group", failure_group = %fp,
        matched = report.matched, discarded = report.affected, skipped = report.skipped, "console action");
    let mut doc = json::bulk_discard(&report);
    doc["limit"] = doc!(max);
    result(
        &ctx,
        StatusCode::OK,
        doc,
        format!(
            "Discarded {} of {} dead letters of failure group {fp} ({} skipped).",
            report.affected, report.matched, report.skipped
        ),
        format!("{}/failures", ctx.base),
    )
}

/// `POST /halts/resume` with `group`.
pub(crate) async fn resume<C: OperatorConnection>(
    state: Shared<C>,
    Extension(ctx): Extension<Ctx>,
    body: Bytes,
) -> Response {
    let form: ActionForm = match parse_form(&ctx, &body) {
        Ok(f) => f,
        Err(r) => return *r,
    };
    let Some(group) = form.group.clone().filter(|g| !g.is_empty()) else {
        return problem(&ctx, StatusCode::BAD_REQUEST, "the form names no group");
    };
    if let Err(e) = inbox_core::ConsumerGroup::new(&group) {
        return problem(&ctx, StatusCode::BAD_REQUEST, &e.to_string());
    }
    if !form.confirmed() {
        return confirmation(
            &ctx,
            "/halts/resume",
            format!("Resume consumer group {group}? Its consumers resume at their next halt poll; fix the cause first."),
            1,
            &[("group", group.as_str())],
        );
    }
    let g = group.clone();
    let resumed = match blocking(&state.0, move |op| op.resume_group(&g)).await {
        Ok(r) => r,
        Err(e) => return store_failed(&ctx, &e),
    };
    tracing::info!(target: "inbox_web::audit", who = %ctx.who, action = "resume", consumer_group = %group, resumed, "console action");
    let doc = doc!({ "consumer_group": group, "resumed": resumed });
    if resumed {
        result(
            &ctx,
            StatusCode::OK,
            doc,
            format!("Consumer group {group} resumed."),
            format!("{}/halts", ctx.base),
        )
    } else {
        result(
            &ctx,
            StatusCode::NOT_FOUND,
            doc,
            format!("Refused: consumer group {group} is not halted."),
            format!("{}/halts", ctx.base),
        )
    }
}

/// `POST /outbox/revive` with `id`.
pub(crate) async fn revive<C: OperatorConnection>(
    state: Shared<C>,
    Extension(ctx): Extension<Ctx>,
    body: Bytes,
) -> Response {
    let form: ActionForm = match parse_form(&ctx, &body) {
        Ok(f) => f,
        Err(r) => return *r,
    };
    let Some(id) = form.id.as_deref().and_then(|i| i.parse::<i64>().ok()) else {
        return problem(
            &ctx,
            StatusCode::BAD_REQUEST,
            "the form names no outbox row id (a number)",
        );
    };
    if !form.confirmed() {
        return confirmation(
            &ctx,
            "/outbox/revive",
            format!("Revive dead outbox row {id}? It is due now, its attempts back to 0."),
            1,
            &[("id", id.to_string().as_str())],
        );
    }
    let revived = match blocking(&state.0, move |op| op.store().revive_outbox_rows(&[id])).await {
        Ok(n) => n == 1,
        Err(e) => return store_failed(&ctx, &e),
    };
    tracing::info!(target: "inbox_web::audit", who = %ctx.who, action = "revive", outbox_row = id, revived, "console action");
    let doc = doc!({ "id": id, "revived": revived });
    let back = format!("{}/outbox", ctx.base);
    if revived {
        result(
            &ctx,
            StatusCode::OK,
            doc,
            format!("Outbox row {id} revived."),
            back,
        )
    } else {
        result(
            &ctx,
            StatusCode::CONFLICT,
            doc,
            format!("Refused: outbox row {id} is not dead."),
            back,
        )
    }
}

/// The login form's fields.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct LoginForm {
    token: Option<String>,
}

/// `POST /login`: a session for the right token.
pub(crate) async fn login<C: OperatorConnection>(
    state: Shared<C>,
    Extension(ctx): Extension<Ctx>,
    body: Bytes,
) -> Response {
    let form: LoginForm = match parse_form(&ctx, &body) {
        Ok(f) => f,
        Err(r) => return *r,
    };
    if !state.keys.token_required() {
        return problem(
            &ctx,
            StatusCode::NOT_FOUND,
            "this console has no login: its host's auth layer admits visitors",
        );
    }
    if !state
        .keys
        .token_matches(form.token.as_deref().unwrap_or_default())
    {
        tracing::warn!(target: "inbox_web::audit", "console: a login with a wrong token refused");
        return login_page(&ctx, StatusCode::UNAUTHORIZED, Some("wrong token"));
    }
    let (_, value) = state.keys.issue(Kind::Login);
    let path = if ctx.base.is_empty() {
        "/".to_owned()
    } else {
        ctx.base.clone()
    };
    tracing::info!(target: "inbox_web::audit", "console: logged in with the token");
    let mut response = Redirect::to(&crate::home(&ctx)).into_response();
    if let Ok(v) = session::set_cookie(&value, &path, state.secure_cookie).parse() {
        response.headers_mut().append(header::SET_COOKIE, v);
    }
    response
}

/// `POST /logout`: ends the browser's session.
pub(crate) async fn logout<C: OperatorConnection>(
    state: Shared<C>,
    Extension(ctx): Extension<Ctx>,
) -> Response {
    let path = if ctx.base.is_empty() {
        "/".to_owned()
    } else {
        ctx.base.clone()
    };
    let to = if state.keys.token_required() {
        format!("{}/login", ctx.base)
    } else {
        crate::home(&ctx)
    };
    let mut response = Redirect::to(&to).into_response();
    if let Ok(v) = session::clear_cookie(&path, state.secure_cookie).parse() {
        response.headers_mut().append(header::SET_COOKIE, v);
    }
    response
}
