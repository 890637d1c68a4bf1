"""Index directories: the registry of index kinds, versioned directories published by atomic
rename, building a version from a corpus, and the pre-training index refresher."""
