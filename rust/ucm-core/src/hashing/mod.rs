//! Chained block hashing (implemented by the hashing work item).
