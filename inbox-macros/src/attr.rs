//! Reads and checks the `#[inbox(...)]` attributes of one derive.

use std::collections::BTreeMap;
use std::time::Duration;

use proc_macro2::{Span, TokenTree};
use quote::ToTokens;
use syn::meta::ParseNestedMeta;
use syn::parse::ParseStream;
use syn::punctuated::Punctuated;
use syn::{
    Data, DeriveInput, ExprPath, LitInt, LitStr, Token, Type, TypeImplTrait, TypeParamBound,
};

use crate::ctxt::Ctxt;
use crate::names;
use crate::retry::{self, PolicyProblem, Shown};

const KEYS: &str = "`group`, `message`, `message_type`, `connection`, `handle`, `fold`, \
                    `lock`, `max_attempts`, `backoff` or `retry_policy`";

/// Everything the derive needs, checked.
pub(crate) struct Spec {
    /// The consumer group's name, a valid one.
    pub(crate) group: LitStr,
    /// The decoded message type.
    pub(crate) message: Type,
    /// The message type string the transport dispatches on.
    pub(crate) message_type: LitStr,
    /// Which connection types get an impl.
    pub(crate) connection: Connection,
    /// The method handling one message; `None` is `Self::handle`.
    pub(crate) handle: Option<ExprPath>,
    /// The fold hook, if any.
    pub(crate) fold: Option<ExprPath>,
    /// The projection lock, if any.
    pub(crate) lock: Option<Lock>,
    /// Where the retry policy comes from.
    pub(crate) retry: Retry,
}

/// `lock = ...`.
pub(crate) enum Lock {
    /// `lock = "name"`: `ProjectionLock::named("name")`.
    Named(LitStr),
    /// `lock = serialized("name")`: `ProjectionLock::serialized("name")`.
    Serialized(LitStr),
    /// `lock = path`: `path(&self) -> ProjectionLock`.
    Hook(ExprPath),
}

/// `connection = ...`.
pub(crate) enum Connection {
    /// `[PgConnection, SqliteConnection]` (or one type): one impl per type.
    Types(Vec<Type>),
    /// `impl UsageDb + Send`: one impl generic over every such connection.
    Generic(Punctuated<TypeParamBound, Token![+]>),
}

/// Where `Handler::retry_policy` comes from.
pub(crate) enum Retry {
    /// Neither `max_attempts` nor `backoff` nor `retry_policy`: the trait's default.
    Default,
    /// `max_attempts` and/or `backoff`, the rest from the defaults; checked.
    Fixed {
        max_attempts: u32,
        initial: Duration,
        max: Duration,
    },
    /// `retry_policy = path`: `path(&self) -> RetryPolicy`.
    Hook(ExprPath),
}

/// `backoff(initial = "...", max = "...")`.
#[derive(Default)]
struct Backoff {
    initial: Option<(Duration, LitStr)>,
    max: Option<(Duration, LitStr)>,
}

/// The attribute values read so far, before the checks that look at several.
#[derive(Default)]
struct Attrs {
    /// Every key given, with the span of its first occurrence (also when its value
    /// did not parse, so it is not reported missing as well).
    seen: BTreeMap<&'static str, Span>,
    group: Option<LitStr>,
    message: Option<Type>,
    message_type: Option<LitStr>,
    connection: Option<Connection>,
    handle: Option<ExprPath>,
    fold: Option<ExprPath>,
    lock: Option<Lock>,
    retry_policy: Option<ExprPath>,
    max_attempts: Option<(u32, LitInt)>,
    backoff: Option<Backoff>,
}

/// Reads the derive input's attributes; `None` when something required is missing
/// or malformed (the errors are in `cx`).
pub(crate) fn parse(cx: &mut Ctxt, input: &DeriveInput) -> Option<Spec> {
    let mut attrs = Attrs::default();
    let mut last_attr: Option<&syn::Attribute> = None;
    for attr in input.attrs.iter().filter(|a| a.path().is_ident("inbox")) {
        last_attr = Some(attr);
        let parsed = attr.parse_nested_meta(|meta| {
            let key_span = span_of(&meta.path);
            let Some(key) = meta.path.get_ident().map(ToString::to_string) else {
                cx.error_spanned_by(
                    &meta.path,
                    format!("unknown inbox attribute, expected {KEYS}"),
                );
                skip_value(meta.input);
                return Ok(());
            };
            let Some(key) = known_key(&key) else {
                cx.error_spanned_by(
                    &meta.path,
                    format!("unknown inbox attribute `{key}`, expected {KEYS}"),
                );
                skip_value(meta.input);
                return Ok(());
            };
            if attrs.seen.contains_key(key) {
                cx.error_spanned_by(&meta.path, format!("duplicate inbox attribute `{key}`"));
                skip_value(meta.input);
                return Ok(());
            }
            attrs.seen.insert(key, key_span);
            if let Err(err) = attrs.read(cx, key, &meta) {
                cx.syn_error(err);
                skip_value(meta.input);
            }
            Ok(())
        });
        if let Err(err) = parsed {
            cx.syn_error(err);
        }
    }
    misplaced_attrs(cx, input);

    let missing: Vec<&str> = [
        ("group", "`group = \"...\"`"),
        ("message", "`message = Type`"),
        ("message_type", "`message_type = \"...\"`"),
        ("connection", "`connection = [Connection, ...]`"),
    ]
    .into_iter()
    .filter(|(key, _)| !attrs.seen.contains_key(key))
    .map(|(_, example)| example)
    .collect();
    match (last_attr, missing.is_empty()) {
        (_, true) => {}
        (None, false) => cx.error_at(
            input.ident.span(),
            "#[derive(Handler)] needs an #[inbox(group = \"...\", message = Type, \
             message_type = \"...\", connection = [Connection, ...])] attribute",
        ),
        (Some(attr), false) => cx.error_spanned_by(
            attr,
            format!("#[inbox(...)] is missing {}", missing.join(", ")),
        ),
    }

    let retry = attrs.retry(cx);
    Some(Spec {
        group: attrs.group?,
        message: attrs.message?,
        message_type: attrs.message_type?,
        connection: attrs.connection?,
        handle: attrs.handle,
        fold: attrs.fold,
        lock: attrs.lock,
        retry: retry?,
    })
}

fn known_key(key: &str) -> Option<&'static str> {
    [
        "group",
        "message",
        "message_type",
        "connection",
        "handle",
        "fold",
        "lock",
        "max_attempts",
        "backoff",
        "retry_policy",
    ]
    .into_iter()
    .find(|k| *k == key)
}

impl Attrs {
    /// Reads the value of `key` (already known, not a duplicate).
    fn read(
        &mut self,
        cx: &mut Ctxt,
        key: &'static str,
        meta: &ParseNestedMeta<'_>,
    ) -> syn::Result<()> {
        let input = meta.input;
        match key {
            "group" => {
                let lit: LitStr = value(input)?.parse()?;
                // The same rules as `ConsumerGroup::new`: one copy, in the inbox-names crate.
                if let Err(problem) = names::check_group_name(&lit.value()) {
                    cx.error_spanned_by(&lit, format!("invalid consumer group: {problem}"));
                }
                self.group = Some(lit);
            }
            "message" => self.message = Some(value(input)?.parse()?),
            "message_type" => {
                let lit: LitStr = value(input)?.parse()?;
                if lit.value().is_empty() {
                    cx.error_spanned_by(&lit, "message_type must not be empty");
                }
                self.message_type = Some(lit);
            }
            "connection" => {
                if let Some(connection) = read_connection(cx, value(input)?)? {
                    self.connection = Some(connection);
                }
            }
            "handle" => self.handle = Some(value(input)?.parse()?),
            "fold" => self.fold = Some(value(input)?.parse()?),
            "lock" => {
                let input = value(input)?;
                let named = |cx: &mut Ctxt, lit: LitStr| {
                    if lit.value().is_empty() {
                        cx.error_spanned_by(&lit, "a lock name must not be empty");
                    }
                    lit
                };
                self.lock = Some(if input.peek(LitStr) {
                    Lock::Named(named(cx, input.parse()?))
                } else {
                    let path: ExprPath = input.parse()?;
                    if path.path.is_ident("serialized") && input.peek(syn::token::Paren) {
                        let inner;
                        syn::parenthesized!(inner in input);
                        Lock::Serialized(named(cx, inner.parse()?))
                    } else {
                        Lock::Hook(path)
                    }
                });
            }
            "retry_policy" => self.retry_policy = Some(value(input)?.parse()?),
            "max_attempts" => {
                let lit: LitInt = value(input)?.parse()?;
                let n = lit.base10_parse::<u32>()?;
                self.max_attempts = Some((n, lit));
            }
            "backoff" => self.backoff = Some(read_backoff(cx, meta)?),
            _ => unreachable!("known_key lists every key read handles"),
        }
        Ok(())
    }

    /// Checks the retry settings together; `None` after an error.
    fn retry(&self, cx: &mut Ctxt) -> Option<Retry> {
        if let Some(hook) = &self.retry_policy {
            let mut conflict = false;
            for key in ["max_attempts", "backoff"] {
                if let Some(span) = self.seen.get(key) {
                    cx.error_at(
                        *span,
                        format!(
                            "`{key}` and `retry_policy` both set the retry policy; \
                             give `max_attempts`/`backoff`, or `retry_policy`, not both"
                        ),
                    );
                    conflict = true;
                }
            }
            return (!conflict).then(|| Retry::Hook(hook.clone()));
        }
        if !self.seen.contains_key("max_attempts") && !self.seen.contains_key("backoff") {
            return Some(Retry::Default);
        }
        // A value that did not parse was reported already.
        if self.seen.contains_key("max_attempts") && self.max_attempts.is_none()
            || self.seen.contains_key("backoff") && self.backoff.is_none()
        {
            return None;
        }
        let empty = Backoff::default();
        let backoff = self.backoff.as_ref().unwrap_or(&empty);
        let max_attempts = self
            .max_attempts
            .as_ref()
            .map_or(retry::DEFAULT_MAX_ATTEMPTS, |(n, _)| *n);
        let initial = backoff
            .initial
            .as_ref()
            .map_or(retry::DEFAULT_INITIAL, |v| v.0);
        let max = backoff.max.as_ref().map_or(retry::DEFAULT_MAX, |v| v.0);
        let problems = retry::policy_problems(max_attempts, initial, max);
        for problem in &problems {
            match problem {
                PolicyProblem::NoAttempts => {
                    if let Some((_, lit)) = &self.max_attempts {
                        cx.error_spanned_by(lit, "max_attempts must be at least 1, found 0");
                    }
                }
                PolicyProblem::ZeroInitial => {
                    if let Some((_, lit)) = &backoff.initial {
                        cx.error_spanned_by(lit, "initial backoff must be greater than zero");
                    }
                }
                PolicyProblem::MaxAboveCap => {
                    if let Some((_, lit)) = &backoff.max {
                        cx.error_spanned_by(
                            lit,
                            format!(
                                "max backoff must be at most 8760h (a year), found {}",
                                Shown(max)
                            ),
                        );
                    }
                }
                PolicyProblem::InitialAboveMax => {
                    let default = |given: &Option<(Duration, LitStr)>| {
                        if given.is_some() {
                            ""
                        } else {
                            " (the default)"
                        }
                    };
                    let message = format!(
                        "initial backoff {}{} must not exceed max backoff {}{}",
                        Shown(initial),
                        default(&backoff.initial),
                        Shown(max),
                        default(&backoff.max),
                    );
                    match (&backoff.initial, &backoff.max) {
                        (Some((_, lit)), _) | (None, Some((_, lit))) => {
                            cx.error_spanned_by(lit, message);
                        }
                        (None, None) => {}
                    }
                }
            }
        }
        problems.is_empty().then_some(Retry::Fixed {
            max_attempts,
            initial,
            max,
        })
    }
}

/// `= ` before a value.
fn value(input: ParseStream<'_>) -> syn::Result<ParseStream<'_>> {
    input.parse::<Token![=]>()?;
    Ok(input)
}

/// `[A, B]`, `A`, or `impl Bound + ...`; `None` after an error reported in `cx`.
fn read_connection(cx: &mut Ctxt, input: ParseStream<'_>) -> syn::Result<Option<Connection>> {
    if input.peek(syn::token::Bracket) {
        let content;
        let brackets = syn::bracketed!(content in input);
        let types = Punctuated::<Type, Token![,]>::parse_terminated(&content)?;
        if types.is_empty() {
            cx.error_at(
                brackets.span.join(),
                "list at least one connection type, like `connection = [PgConnection]`",
            );
            return Ok(None);
        }
        let mut distinct: Vec<(String, Type)> = Vec::with_capacity(types.len());
        let mut repeated = false;
        for ty in types {
            let text = ty.to_token_stream().to_string();
            if distinct.iter().any(|(seen, _)| *seen == text) {
                cx.error_spanned_by(&ty, "connection type listed twice");
                repeated = true;
            } else {
                distinct.push((text, ty));
            }
        }
        let types = distinct.into_iter().map(|(_, ty)| ty).collect();
        return Ok((!repeated).then_some(Connection::Types(types)));
    }
    match input.parse::<Type>()? {
        Type::ImplTrait(TypeImplTrait { bounds, .. }) => Ok(Some(Connection::Generic(bounds))),
        ty => Ok(Some(Connection::Types(vec![ty]))),
    }
}

/// `(initial = "1s", max = "5m")`, either optional.
fn read_backoff(cx: &mut Ctxt, meta: &ParseNestedMeta<'_>) -> syn::Result<Backoff> {
    let mut backoff = Backoff::default();
    meta.parse_nested_meta(|meta| {
        let slot = if meta.path.is_ident("initial") {
            &mut backoff.initial
        } else if meta.path.is_ident("max") {
            &mut backoff.max
        } else {
            let key = meta.path.to_token_stream().to_string().replace(' ', "");
            cx.error_spanned_by(
                &meta.path,
                format!("unknown backoff setting `{key}`, expected `initial` or `max`"),
            );
            skip_value(meta.input);
            return Ok(());
        };
        if slot.is_some() {
            cx.error_spanned_by(&meta.path, "duplicate backoff setting");
            skip_value(meta.input);
            return Ok(());
        }
        let lit: LitStr = value(meta.input)?.parse()?;
        match retry::parse_duration(&lit.value()) {
            Ok(duration) => *slot = Some((duration, lit)),
            Err(problem) => cx.error_spanned_by(&lit, problem),
        }
        Ok(())
    })?;
    Ok(backoff)
}

/// Reports `#[inbox]` on fields and variants, where it would be ignored.
fn misplaced_attrs(cx: &mut Ctxt, input: &DeriveInput) {
    let fields: Vec<&syn::Field> = match &input.data {
        Data::Struct(data) => data.fields.iter().collect(),
        Data::Enum(data) => data.variants.iter().flat_map(|v| v.fields.iter()).collect(),
        Data::Union(data) => data.fields.named.iter().collect(),
    };
    let variant_attrs = match &input.data {
        Data::Enum(data) => data.variants.iter().flat_map(|v| v.attrs.iter()).collect(),
        _ => Vec::new(),
    };
    let field_attrs = fields.iter().flat_map(|f| f.attrs.iter());
    for attr in field_attrs.chain(variant_attrs) {
        if attr.path().is_ident("inbox") {
            cx.error_spanned_by(attr, "#[inbox(...)] belongs on the handler struct itself");
        }
    }
}

/// Skips to the next `,` of this attribute after a value that did not parse, so the
/// keys after it are still read and checked.
fn skip_value(input: ParseStream<'_>) {
    let _ = input.step(|cursor| {
        let mut rest = *cursor;
        while let Some((tt, next)) = rest.token_tree() {
            if matches!(&tt, TokenTree::Punct(p) if p.as_char() == ',') {
                break;
            }
            rest = next;
        }
        Ok(((), rest))
    });
}

fn span_of(path: &syn::Path) -> Span {
    path.segments
        .first()
        .map_or_else(Span::call_site, |s| s.ident.span())
}
