//! The HTML: one layout, the pieces the pages share, a letter's payload shown safely,
//! and the activity chart as SVG.
//!
//! Every value is interpolated through maud, which escapes it for the place it lands
//! (text or a quoted attribute); nothing is written with `PreEscaped` but the
//! console's own constant markup. No page carries a script or an inline style (the
//! Content-Security-Policy forbids both): the stylesheet is `/assets/console.css`.

use std::fmt::Write as _;

use chrono::{DateTime, SecondsFormat, Utc};
use maud::{html, Markup, PreEscaped, DOCTYPE};

use crate::Ctx;

/// How much of a payload a letter's page shows.
pub(crate) const PAYLOAD_SHOWN: usize = 64 * 1024;
/// How much of a non-UTF-8 payload is shown as hex.
pub(crate) const HEX_SHOWN: usize = 4 * 1024;
/// How much of one header value, error or key a page shows.
pub(crate) const TEXT_SHOWN: usize = 4 * 1024;

/// The stylesheet (served at `/assets/console.css`).
pub(crate) const CSS: &str = "\
body{font-family:system-ui,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}\
header{background:#1d2330;color:#fff;padding:.6rem 1rem;display:flex;gap:1.2rem;align-items:center;flex-wrap:wrap}\
header a{color:#cfe0ff;text-decoration:none}header a:hover{text-decoration:underline}\
header .brand{font-weight:700;color:#fff}header form{margin-left:auto}\
main{padding:1rem 1.4rem;max-width:1400px}h1{font-size:1.35rem;margin:.3rem 0 1rem}\
h2{font-size:1.1rem;margin:1.4rem 0 .5rem}\
table{border-collapse:collapse;background:#fff;width:100%;font-size:.9rem}\
th,td{border:1px solid #dde1e8;padding:.3rem .5rem;text-align:left;vertical-align:top}\
th{background:#eef1f5}td.num{text-align:right;font-variant-numeric:tabular-nums}\
code,pre{font-family:ui-monospace,monospace;font-size:.85rem}\
pre{background:#fff;border:1px solid #dde1e8;padding:.6rem;overflow:auto;max-height:32rem;white-space:pre-wrap;word-break:break-all}\
.err{color:#9b1c1c}.muted{color:#667085}.ok{color:#0f6b36}\
.notice{padding:.6rem .8rem;border:1px solid #dde1e8;background:#fff;margin:.6rem 0}\
.notice.bad{border-color:#e5a0a0;background:#fff5f5}.notice.good{border-color:#9fd3b3;background:#f3fbf6}\
form.inline{display:inline}button{cursor:pointer;padding:.25rem .7rem}\
button.danger{background:#9b1c1c;color:#fff;border:1px solid #7a1515}\
button.primary{background:#1f4fd1;color:#fff;border:1px solid #173ea6}\
.filters{display:flex;gap:.5rem;flex-wrap:wrap;align-items:end;margin:.5rem 0 1rem}\
.filters label{display:flex;flex-direction:column;font-size:.8rem}\
dl{display:grid;grid-template-columns:max-content auto;gap:.25rem 1rem;background:#fff;border:1px solid #dde1e8;padding:.6rem}\
dt{font-weight:600}dd{margin:0;word-break:break-all}\
.cards{display:flex;gap:1rem;flex-wrap:wrap}.card{background:#fff;border:1px solid #dde1e8;padding:.6rem .9rem;min-width:11rem}\
.card b{display:block;font-size:1.4rem}.pager{margin:.8rem 0;display:flex;gap:1rem}\
svg text{font-family:system-ui,sans-serif;font-size:11px}";

/// The page around a body.
pub(crate) fn page(ctx: &Ctx, title: &str, body: Markup) -> Markup {
    let base = &ctx.base;
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                meta name="referrer" content="same-origin";
                title { (title) " · inbox console" }
                link rel="stylesheet" href={ (base) "/assets/console.css" };
            }
            body {
                header {
                    a.brand href=(crate::home(ctx)) { "inbox console" }
                    a href=(crate::home(ctx)) { "Overview" }
                    a href={ (base) "/failures" } { "Failure groups" }
                    a href={ (base) "/letters" } { "Dead letters" }
                    a href={ (base) "/halts" } { "Halted groups" }
                    a href={ (base) "/outbox" } { "Outbox" }
                    a href={ (base) "/claims" } { "Claims" }
                    a href={ (base) "/rebuilds" } { "Rebuilds" }
                    @if ctx.read_only { span.muted { "read-only" } }
                    @if ctx.logged_in {
                        form.inline method="post" action={ (base) "/logout" } {
                            (csrf_field(ctx))
                            button type="submit" { "Log out" }
                        }
                    }
                }
                main { (body) }
            }
        }
    }
}

/// The hidden CSRF field of a form.
pub(crate) fn csrf_field(ctx: &Ctx) -> Markup {
    html! { input type="hidden" name="csrf" value=(ctx.csrf); }
}

/// A time as RFC 3339 UTC to the second.
pub(crate) fn time(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Secs, true)
}

/// An optional time, or a dash.
pub(crate) fn time_or_dash(t: Option<DateTime<Utc>>) -> String {
    t.map_or_else(|| "-".to_owned(), time)
}

/// At most `max` bytes of `text` (cut at a character boundary), and whether it was cut.
pub(crate) fn bounded(text: &str, max: usize) -> (&str, bool) {
    if text.len() <= max {
        return (text, false);
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    (&text[..end], true)
}

/// A bounded text, with a note when cut.
pub(crate) fn text(value: &str) -> Markup {
    let (shown, cut) = bounded(value, TEXT_SHOWN);
    html! {
        (shown)
        @if cut { span.muted { " … (" (value.len()) " bytes)" } }
    }
}

/// The first line of an error, at most 160 characters.
pub(crate) fn first_line(text: Option<&str>) -> String {
    let line = text.unwrap_or_default().lines().next().unwrap_or_default();
    if line.chars().count() > 160 {
        let cut: String = line.chars().take(157).collect();
        format!("{cut}...")
    } else {
        line.to_owned()
    }
}

/// A payload as a page shows it: pretty JSON where it is JSON, text where it is
/// UTF-8, hex otherwise; never more than [`PAYLOAD_SHOWN`] bytes of it.
pub(crate) fn payload(bytes: &[u8]) -> Markup {
    match std::str::from_utf8(bytes) {
        Ok(text) => {
            let pretty = (text.len() <= 1024 * 1024)
                .then(|| serde_json::from_str::<serde_json::Value>(text).ok())
                .flatten()
                .and_then(|v| serde_json::to_string_pretty(&v).ok());
            let (kind, body) = match &pretty {
                Some(p) => ("JSON", p.as_str()),
                None => ("text", text),
            };
            let (shown, cut) = bounded(body, PAYLOAD_SHOWN);
            html! {
                p.muted { (kind) ", " (bytes.len()) " bytes"
                    @if cut { "; the first " (shown.len()) " bytes are shown" } }
                pre #payload { (shown) }
            }
        }
        Err(_) => {
            let shown = &bytes[..bytes.len().min(HEX_SHOWN)];
            let mut hex = String::with_capacity(shown.len() * 3);
            for (i, b) in shown.iter().enumerate() {
                let sep = if i % 32 == 31 { '\n' } else { ' ' };
                let _ = write!(hex, "{b:02x}{sep}");
            }
            html! {
                p.muted { "not UTF-8, " (bytes.len()) " bytes, shown as hex"
                    @if shown.len() < bytes.len() { "; the first " (shown.len()) " bytes are shown" } }
                pre #payload { (hex) }
            }
        }
    }
}

/// A notice box.
pub(crate) fn notice(good: bool, message: &str) -> Markup {
    html! { div.notice.(if good { "good" } else { "bad" }) #notice { (message) } }
}

/// One bar series of the chart: (interval start, processed, dead-lettered, at least).
pub(crate) struct ChartPoint {
    pub(crate) start: DateTime<Utc>,
    pub(crate) processed: u64,
    pub(crate) dead_lettered: u64,
    pub(crate) at_least: bool,
}

/// Processed and dead-lettered messages per interval as an SVG bar chart: two bars
/// per interval on one scale each (processed on the left axis, dead letters on the
/// right), with the interval's start under every fourth bar.
pub(crate) fn chart(points: &[ChartPoint]) -> Markup {
    const W: f64 = 960.0;
    const H: f64 = 220.0;
    const PAD: f64 = 36.0;
    let n = points.len().max(1) as f64;
    let slot = (W - 2.0 * PAD) / n;
    let max_p = points.iter().map(|p| p.processed).max().unwrap_or(0).max(1) as f64;
    let max_d = points
        .iter()
        .map(|p| p.dead_lettered)
        .max()
        .unwrap_or(0)
        .max(1) as f64;
    let inner = H - 2.0 * PAD;
    let mut bars = String::new();
    for (i, p) in points.iter().enumerate() {
        let x = PAD + i as f64 * slot;
        let hp = inner * p.processed as f64 / max_p;
        let hd = inner * p.dead_lettered as f64 / max_d;
        let w = (slot / 2.0 - 1.0).max(1.0);
        let _ = write!(
            bars,
            r##"<rect x="{x:.1}" y="{:.1}" width="{w:.1}" height="{hp:.1}" fill="#3b6fd8"><title>{} processed{}</title></rect>"##,
            H - PAD - hp,
            p.processed,
            if p.at_least { " or more" } else { "" }
        );
        let _ = write!(
            bars,
            r##"<rect x="{:.1}" y="{:.1}" width="{w:.1}" height="{hd:.1}" fill="#c03b3b"><title>{} dead-lettered</title></rect>"##,
            x + slot / 2.0,
            H - PAD - hd,
            p.dead_lettered
        );
        if i % 4 == 0 {
            let _ = write!(
                bars,
                r##"<text x="{x:.1}" y="{:.1}" fill="#667085">{}</text>"##,
                H - PAD + 14.0,
                p.start.format("%d %H:%M")
            );
        }
    }
    // Everything in `bars` is numbers and dates formatted above, never stored text.
    html! {
        svg #chart xmlns="http://www.w3.org/2000/svg" width="100%" viewBox={ "0 0 " (W) " " (H) }
            role="img" aria-label="processed and dead-lettered messages per interval" {
            line x1=(PAD) y1=(H - PAD) x2=(W - PAD) y2=(H - PAD) stroke="#98a2b3" {}
            text x="4" y="14" fill="#3b6fd8" { "processed (max " (max_p as u64) ")" }
            text x=(W - 200.0) y="14" fill="#c03b3b" { "dead-lettered (max " (max_d as u64) ")" }
            (PreEscaped(bars))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_cuts_at_a_character_boundary() {
        let s = "ééé";
        assert_eq!(bounded(s, 3), ("é", true));
        assert_eq!(bounded(s, 6), ("ééé", false));
    }

    #[test]
    fn payloads_are_escaped_and_bounded() {
        let html = payload(b"<script>alert(1)</script>").into_string();
        assert!(!html.contains("<script>"), "{html}");
        assert!(html.contains("&lt;script&gt;"));
        let big = vec![b'a'; PAYLOAD_SHOWN * 3];
        let html = payload(&big).into_string();
        assert!(html.len() < PAYLOAD_SHOWN + 1024);
        let html = payload(&[0xff, 0xfe, b'<']).into_string();
        assert!(html.contains("ff fe 3c"), "{html}");
        let html = payload(br#"{"a":"</pre><b>"}"#).into_string();
        assert!(
            html.contains("JSON") && html.contains("&lt;/pre&gt;&lt;b&gt;"),
            "{html}"
        );
    }
}
