//! `web`: the web console (inbox-web) served on its own until ctrl-c or SIGTERM.

use std::io::Write;

use inbox_diesel::operator::{Operator, OperatorConnection, ReplayTarget};
use inbox_diesel::Store;
use inbox_web::Console;

use crate::args::WebArgs;
use crate::exit;
use crate::failure::{failed, Failure, Outcome};
use crate::output::print;

pub(crate) fn serve<C: OperatorConnection>(
    store: &Store<C>,
    target: ReplayTarget,
    args: &WebArgs,
    out: &mut dyn Write,
) -> Outcome {
    let mut console = Console::new(Operator::new(store))
        .replay_target(target)
        .read_only(args.read_only)
        .secure_cookie(args.secure_cookie);
    if let Some(token) = &args.token {
        console = console.token(token.clone());
    }
    if let Some(header) = &args.identity_header {
        if axum::http::HeaderName::from_bytes(header.as_bytes()).is_err() {
            return Err(Failure::new(
                exit::USAGE,
                format!("--identity-header: not a header name: {header:?}"),
            ));
        }
        console = console.identity_header(header);
    }
    for origin in &args.allow_origin {
        console = console.allow_origin(origin.clone());
    }
    console
        .check_listen(args.listen)
        .map_err(|e| Failure::new(exit::USAGE, e.to_string()))?;
    let router = console.router();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(failed)?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .map_err(|e| {
                Failure::new(
                    exit::FAILURE,
                    format!("cannot listen on {}: {e}", args.listen),
                )
            })?;
        let local = listener.local_addr().map_err(failed)?;
        print(
            out,
            format!(
                "inbox: console on http://{local}/{}\n",
                if args.read_only { " (read-only)" } else { "" }
            ),
        )?;
        let _ = out.flush();
        let shutdown = inbox_amqp::cancel_on_signals(inbox_amqp::CancellationToken::new());
        axum::serve(listener, router)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await
            .map_err(failed)
    })
}
