"""cdc-relay: relay transactional-outbox events from PostgreSQL to Kafka by tailing the WAL."""

from cdc_relay import _hot_path

__version__ = "0.2.0"

# Where the project lives; pyproject.toml's [project.urls] says the same (a test holds them equal).
HOMEPAGE_URL = "https://github.com/cdc-relay/cdc-relay"
DOCS_URL = "https://cdc-relay.github.io/cdc-relay/"
ISSUES_URL = f"{HOMEPAGE_URL}/issues"
CHANGELOG_URL = f"{HOMEPAGE_URL}/blob/main/CHANGELOG.md"

_hot_path.install()  # before any per-event module is imported: compiled build or sources
