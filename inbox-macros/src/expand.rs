//! Writes the `Handler` impls of a checked [`Spec`].

use proc_macro2::{Span, TokenStream, TokenTree};
use quote::{quote, quote_spanned, ToTokens};
use syn::{parse_quote, Data, DeriveInput, ExprPath, Generics, Ident, Type};

use crate::attr::{self, Connection, Lock, Retry, Spec};
use crate::ctxt::Ctxt;

/// The whole derive: the impls, or every error found.
/// `root` is the path the generated code names inbox-core by (`::inbox_core`, or the
/// facade's hidden re-export of it).
pub(crate) fn derive(input: &DeriveInput, root: &TokenStream) -> Result<TokenStream, TokenStream> {
    let mut cx = Ctxt::default();
    match &input.data {
        Data::Struct(_) => {}
        Data::Enum(data) => cx.error_at(
            data.enum_token.span,
            "#[derive(Handler)] only supports structs: a handler is one consumer, so \
             declare it as a struct (an enum can be one of its fields)",
        ),
        Data::Union(data) => cx.error_at(
            data.union_token.span,
            "#[derive(Handler)] only supports structs, not unions",
        ),
    }
    let spec = attr::parse(&mut cx, input);
    cx.finish()?;
    let Some(spec) = spec else {
        // `attr::parse` reports every reason it returns `None`; this is a backstop.
        return Err(
            syn::Error::new(input.ident.span(), "invalid #[inbox(...)] attribute")
                .into_compile_error(),
        );
    };
    Ok(impls(input, &spec, root))
}

fn impls(input: &DeriveInput, spec: &Spec, root: &TokenStream) -> TokenStream {
    match &spec.connection {
        Connection::Types(types) => types
            .iter()
            .map(|ty| one_impl(input, spec, ty, None, root))
            .collect(),
        Connection::Generic(bounds) => {
            let param = Ident::new("__InboxConnection", Span::call_site());
            let ty: Type = parse_quote!(#param);
            one_impl(input, spec, &ty, Some(quote!(#param: #bounds)), root)
        }
    }
}

/// `impl Handler<conn> for Struct`, with `extra_param` (the connection parameter of
/// `connection = impl ...`) added to the struct's generics.
fn one_impl(
    input: &DeriveInput,
    spec: &Spec,
    conn: &Type,
    extra_param: Option<TokenStream>,
    root: &TokenStream,
) -> TokenStream {
    let ident = &input.ident;
    let generics = impl_generics(&input.generics, extra_param);
    let (impl_generics, _, where_clause) = generics.split_for_impl();
    let (_, ty_generics, _) = input.generics.split_for_impl();

    let Spec {
        group,
        message,
        message_type,
        ..
    } = spec;
    // The message type keeps the user's span: a type that is not `DeserializeOwned`
    // fails the trait's bound on `Message` right at `message = ...`.
    let message_item = quote_spanned!(span_of(message)=> type Message = #message;);

    let handle = call_path(spec.handle.as_ref(), "handle", ident);
    let handle_guard = inherent_guard("handle");
    let retry = retry_policy(&spec.retry, ident, root);
    let fold = spec.fold.as_ref().map(|fold| {
        quote! {
            fn fold(
                &self,
                conn: &mut #conn,
                batch: &[(Self::Message, #root::MessageContext<'_>)],
            ) -> ::core::option::Option<::core::result::Result<(), #root::HandlerError>> {
                ::core::option::Option::Some(
                    #fold(self, conn, batch).map_err(::core::convert::Into::into),
                )
            }
        }
    });
    let lock = spec.lock.as_ref().map(|lock| {
        let lock = match lock {
            Lock::Named(name) => quote! { #root::ProjectionLock::named(#name) },
            Lock::Serialized(name) => quote! { #root::ProjectionLock::serialized(#name) },
            Lock::Hook(hook) => quote! { #hook(self) },
        };
        quote! {
            fn lock(&self) -> ::core::option::Option<#root::ProjectionLock> {
                ::core::option::Option::Some(#lock)
            }
        }
    });

    quote! {
        #[automatically_derived]
        impl #impl_generics #root::Handler<#conn> for #ident #ty_generics #where_clause {
            #message_item

            fn group(&self) -> &#root::ConsumerGroup {
                // A static, since the derive cannot add a field; the name does not depend
                // on the struct's type parameters.
                static GROUP: ::std::sync::OnceLock<#root::ConsumerGroup> =
                    ::std::sync::OnceLock::new();
                GROUP.get_or_init(|| match #root::ConsumerGroup::new(#group) {
                    ::core::result::Result::Ok(group) => group,
                    ::core::result::Result::Err(_) => ::core::unreachable!(
                        "#[derive(Handler)] checked the consumer group name at compile time"
                    ),
                })
            }

            fn message_type(&self) -> &str {
                #message_type
            }

            #retry

            fn handle(
                &self,
                conn: &mut #conn,
                msg: Self::Message,
                ctx: &#root::MessageContext<'_>,
            ) -> ::core::result::Result<(), #root::HandlerError> {
                #handle_guard
                #handle(self, conn, msg, ctx).map_err(::core::convert::Into::into)
            }

            #fold

            #lock
        }
    }
}

/// The struct's generics, plus the connection parameter, plus `Self: Send + Sync +
/// 'static` (the trait's supertraits) when the struct is generic: the impl then
/// exists for exactly the instances that can be handlers.
fn impl_generics(generics: &Generics, extra_param: Option<TokenStream>) -> Generics {
    let mut generics = generics.clone();
    if !generics.params.is_empty() {
        generics.make_where_clause().predicates.push(parse_quote!(
            Self: ::core::marker::Send + ::core::marker::Sync + 'static
        ));
    }
    if let Some(param) = extra_param {
        generics.params.push(parse_quote!(#param));
    }
    generics
}

/// The path the derive calls for `hook`: the user's, or `Self::<hook>` spanned at the
/// struct's name (where the error goes when that method is missing).
fn call_path(path: Option<&ExprPath>, hook: &str, ident: &Ident) -> TokenStream {
    match path {
        Some(path) if names_the_guarded_method(path, hook) => {
            // `Self::handle` given explicitly: as for the default, keep the user's span
            // on the method name only, so that when it is ambiguous (no inherent method)
            // rustc does not suggest the trait's own method, which would recurse.
            let mut tokens: Vec<TokenTree> = path.to_token_stream().into_iter().collect();
            let prefix = tokens.len().saturating_sub(1);
            for token in &mut tokens[..prefix] {
                token.set_span(Span::call_site());
            }
            tokens.into_iter().collect()
        }
        Some(path) => quote!(#path),
        None => {
            // Only the method name carries the user's span: rustc's suggestions for the
            // `Self::` part (which the user cannot edit) stay hidden in the expansion.
            let method = Ident::new(hook, ident.span());
            quote!(Self::#method)
        }
    }
}

/// Whether `path` is `Something::<hook>` (no generic arguments), which resolves to
/// the trait's own method when the type has no inherent one.
fn names_the_guarded_method(path: &ExprPath, hook: &str) -> bool {
    let segments = &path.path.segments;
    let qualified = segments.len() > 1 || path.qself.is_some();
    qualified
        && segments
            .last()
            .is_some_and(|last| last.ident == hook && last.arguments.is_none())
}

/// Makes `Self::<name>` fail to compile, instead of recursing forever, when the
/// struct has no inherent method `<name>`.
///
/// Inside the trait impl, `Self::handle` means the inherent method if there is one,
/// and otherwise the trait's own `handle`: the very method being defined. This local
/// trait gives every type a second `handle`, so without an inherent one the call is
/// ambiguous (error E0034) rather than unconditional recursion; an inherent method
/// still takes precedence over both.
fn inherent_guard(name: &str) -> TokenStream {
    let method = Ident::new(name, Span::call_site());
    // Named to read well in rustc's "candidate #2 is defined in an impl of the trait".
    let guard = Ident::new(
        &format!("derive_Handler_needs_an_inherent_fn_{name}"),
        Span::call_site(),
    );
    quote! {
        #[allow(dead_code, non_camel_case_types)]
        trait #guard {
            fn #method(&self) {}
        }
        impl<T: ?::core::marker::Sized> #guard for T {}
    }
}

fn retry_policy(retry: &Retry, ident: &Ident, root: &TokenStream) -> TokenStream {
    match retry {
        Retry::Default => TokenStream::new(),
        Retry::Fixed {
            max_attempts,
            initial,
            max,
        } => {
            let (initial_s, initial_ns) = (initial.as_secs(), initial.subsec_nanos());
            let (max_s, max_ns) = (max.as_secs(), max.subsec_nanos());
            // The derive checked these settings with the rules of `RetryPolicy::new`
            // (crate::retry, whose tests compare the two), so `new` cannot fail here.
            quote! {
                fn retry_policy(&self) -> #root::RetryPolicy {
                    match #root::RetryPolicy::new(
                        #max_attempts,
                        ::core::time::Duration::new(#initial_s, #initial_ns),
                        ::core::time::Duration::new(#max_s, #max_ns),
                    ) {
                        ::core::result::Result::Ok(policy) => policy,
                        ::core::result::Result::Err(_) => ::core::unreachable!(
                            "#[derive(Handler)] checked the retry policy at compile time"
                        ),
                    }
                }
            }
        }
        Retry::Hook(path) => {
            let call = call_path(Some(path), "retry_policy", ident);
            let guard = inherent_guard("retry_policy");
            quote! {
                fn retry_policy(&self) -> #root::RetryPolicy {
                    #guard
                    #call(self)
                }
            }
        }
    }
}

/// The span of a type's first token (where rustc's errors about it point).
fn span_of(ty: &Type) -> Span {
    quote!(#ty)
        .into_iter()
        .next()
        .map_or_else(Span::call_site, |t| t.span())
}
