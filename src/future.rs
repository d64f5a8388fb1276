//! The one boxed-future type: what trait objects (the broker adapter, the batch writers' jobs,
//! the FIX ledger) return from their async methods. Here, at the bottom, so that layers which
//! must not depend on each other still name the same type.

use std::future::Future;
use std::pin::Pin;

/// A boxed future, so async methods can be called through trait objects.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;
