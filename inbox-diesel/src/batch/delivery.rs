//! One delivery of a batch, as every step sees it.

use std::sync::Arc;

use inbox_core::{DynHandler, Envelope};

use crate::rows::ClaimRow;

/// One delivery of the batch, with what the store needs to claim it.
pub(super) struct Delivery<'a, C> {
    pub(super) idx: usize,
    pub(super) env: &'a Envelope,
    pub(super) digest: [u8; 32],
    pub(super) handler: Option<&'a Arc<dyn DynHandler<C>>>,
    /// `inbox.delivery`: group and key from the start, the attempt once the message
    /// is claimed, the outcome once decided; its handler runs inside it.
    pub(super) span: tracing::Span,
}

impl<C> Delivery<'_, C> {
    pub(super) fn row(&self) -> ClaimRow<'_> {
        ClaimRow {
            key: self.env.message_key.as_str(),
            message_type: &self.env.message_type,
            tenant: self.env.tenant.as_deref(),
            digest: &self.digest,
            payload: &self.env.payload,
        }
    }

    pub(super) fn key(&self) -> &str {
        self.env.message_key.as_str()
    }
}

/// A handler as the store holds it.
pub(super) type SharedHandler<C> = Arc<dyn DynHandler<C>>;
