//! The producers of pending deferred tensors, by the tag each gave its tensor: how a fused
//! consumer's override finds, from the tensor it is handed ([`crate::deferred::tag`]), what to
//! compute its result from. Each producer kind counts its tags from its own start, so that one
//! kind's tag never names another kind's producer.

use std::sync::{Arc, Weak};

/// Producers of one kind, held weakly: each pending tensor's writer holds its producer, so an
/// entry lives exactly as long as its tensor is pending.
pub(super) struct Producers<T> {
    next_tag: u64,
    entries: Vec<(u64, Weak<T>)>,
}

impl<T> Producers<T> {
    /// No producer yet; the first tag is `first`.
    pub(super) const fn starting_at(first: u64) -> Self {
        Producers {
            next_tag: first,
            entries: Vec::new(),
        }
    }

    /// Records `producer` under a new tag, forgetting the entries whose tensors are gone.
    pub(super) fn insert(&mut self, producer: &Arc<T>) -> u64 {
        self.entries.retain(|(_, weak)| weak.strong_count() > 0);
        let tag = self.next_tag;
        self.next_tag += 1;
        self.entries.push((tag, Arc::downgrade(producer)));
        tag
    }

    /// The producer of tag `tag`, while its tensor is pending.
    pub(super) fn find(&self, tag: u64) -> Option<Arc<T>> {
        (self.entries.iter())
            .find(|(t, _)| *t == tag)
            .and_then(|(_, weak)| weak.upgrade())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tag_finds_its_producer_while_it_lives() {
        let mut producers = Producers::starting_at(1 << 62);
        let (a, b) = (Arc::new('a'), Arc::new('b'));
        let (ta, tb) = (producers.insert(&a), producers.insert(&b));
        assert_eq!((ta, tb), (1 << 62, (1 << 62) + 1));
        assert_eq!(producers.find(tb).as_deref(), Some(&'b'));
        drop(a);
        assert_eq!(producers.find(ta), None);
        assert_eq!(producers.find(7), None);
    }
}
