//! Collects every error of one derive, so the user sees them all in one build.

use std::fmt::Display;

use proc_macro2::{Span, TokenStream};
use quote::ToTokens;

/// The errors found so far, each at the token it is about.
#[derive(Default)]
pub(crate) struct Ctxt {
    errors: Vec<syn::Error>,
}

impl Ctxt {
    /// An error spanning `tokens` (first to last token).
    pub(crate) fn error_spanned_by(&mut self, tokens: impl ToTokens, message: impl Display) {
        self.errors.push(syn::Error::new_spanned(tokens, message));
    }

    /// An error at `span`.
    pub(crate) fn error_at(&mut self, span: Span, message: impl Display) {
        self.errors.push(syn::Error::new(span, message));
    }

    /// A parser's error.
    pub(crate) fn syn_error(&mut self, error: syn::Error) {
        self.errors.push(error);
    }

    /// `Ok` when nothing went wrong, else every error as `compile_error!`s.
    pub(crate) fn finish(self) -> Result<(), TokenStream> {
        let mut errors = self.errors.into_iter();
        let Some(mut first) = errors.next() else {
            return Ok(());
        };
        for error in errors {
            first.combine(error);
        }
        Err(first.into_compile_error())
    }
}
