"""Database engine and sessions from Settings; the embedded SQLite database migrates itself."""

from __future__ import annotations

import functools
import logging
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

from sqlalchemy import Connection, CursorResult, Engine, Executable, create_engine, event, text
from sqlalchemy.exc import OperationalError, ProgrammingError
from sqlalchemy.orm import Session, sessionmaker

from batchllm.errors import BatchLLMError, JobNotFound
from batchllm.settings import Settings

if TYPE_CHECKING:  # alembic is imported when the schema is checked or upgraded
    from alembic.config import Config

log = logging.getLogger(__name__)

T = TypeVar("T")

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"

_lock = threading.Lock()
_engines: dict[str, Engine] = {}


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    # WAL lets `status` read while a run writes; busy_timeout waits instead of failing on a lock.
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def alembic_config(url: str) -> Config:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str) -> None:
    """Bring the schema at `url` to the newest migration."""
    from alembic import command
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        # SQLite creates the file but not its directory (a fresh BATCHLLM_HOME).
        database = Path(parsed.database)
        database.parent.mkdir(parents=True, exist_ok=True)
        with _migration_lock(database):
            command.upgrade(alembic_config(url), "head")
        return
    command.upgrade(alembic_config(url), "head")


@contextmanager
def _migration_lock(database: Path) -> Iterator[None]:
    """Two processes opening a fresh SQLite database at once (`serve` and a `submit`) both ran
    the migrations, and one failed with "duplicate column name". An exclusive lock on a file
    beside the database makes the second wait, then find the schema current."""
    try:
        import fcntl
    except ImportError:  # Windows: no flock; the race stays as it was
        yield
        return
    with open(database.with_name(database.name + ".migrate-lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


_REVISION_LINE = re.compile(r"""^(down_revision|revision)\s*=\s*['"]?([^'"\s]*)['"]?""", re.M)


@functools.cache
def _head_revision() -> str | None:
    """The newest migration's id, read once per process from the scripts' own `revision` and
    `down_revision` lines: the one no other script names as its parent. Alembic's
    ScriptDirectory says the same but its import and load cost ~0.2 s, a seventh of a
    `batchllm run` on a kept engine. A unit test keeps the two in agreement."""
    revisions: set[str] = set()
    parents: set[str] = set()
    for script in (MIGRATIONS_DIR / "versions").glob("*.py"):
        fields = dict(_REVISION_LINE.findall(script.read_text()))
        if "revision" in fields:
            revisions.add(fields["revision"])
            parents.add(fields.get("down_revision", ""))
    heads = revisions - parents
    return heads.pop() if len(heads) == 1 else None


def _is_current(engine: Engine) -> bool:
    with engine.connect() as conn:  # an unreachable database raises here, as it should
        try:
            revision = conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
        except (OperationalError, ProgrammingError):  # a new database: no alembic_version yet
            return False
    return revision == _head_revision()


def get_engine(settings: Settings) -> Engine:
    """The engine of the database `settings` name, made once per URL and process."""
    url = settings.resolved_database_url
    with _lock:
        if url in _engines:
            return _engines[url]
        if url.startswith("sqlite"):
            settings.home.mkdir(parents=True, exist_ok=True)
            # Sized as PostgreSQL's (serve makes it a connection per request thread): the
            # default 5 + 10 made 40 request threads wait for a connection, and opened and
            # closed one (its pragmas, the WAL) per few requests; 15% of a polled server's CPU.
            engine = create_engine(
                url,
                connect_args={"timeout": 30},
                pool_size=settings.db_pool_size,
                max_overflow=settings.db_max_overflow,
            )
            event.listen(engine, "connect", _sqlite_pragmas)
            if not _is_current(engine):  # a new or older database: alembic brings it up
                upgrade(url)
                # The check's pooled connection predates the migrated schema: a new one reads it.
                engine.dispose()
        else:
            # Per process: a fleet's connections are its workers times what each uses.
            engine = create_engine(
                url,
                pool_pre_ping=True,
                pool_size=settings.db_pool_size,
                max_overflow=settings.db_max_overflow,
            )
            if not _is_current(engine):
                raise BatchLLMError(
                    f"the database at {engine.url.render_as_string(hide_password=True)} is not "
                    "at the newest schema: run `batchllm db upgrade`"
                )
        _engines[url] = engine
        return engine


# What a transaction's changes bring with them, done just before it commits, whoever made the
# change: the layers above the store register them (output/commit.py tidies the part files of
# the jobs a transaction ended), so no caller of a state change has a chore to remember.
_BEFORE_COMMIT: list[Callable[[Session], None]] = []
SETTINGS_KEY = "batchllm.settings"


def before_commit(hook: Callable[[Session], None]) -> Callable[[Session], None]:
    """Run `hook(session)` before every commit of `session_scope` (once per hook)."""
    if hook not in _BEFORE_COMMIT:
        _BEFORE_COMMIT.append(hook)
    return hook


_factories: dict[Engine, sessionmaker[Session]] = {}


def _session_factory(engine: Engine) -> sessionmaker[Session]:
    """One sessionmaker per engine: each sessionmaker makes a Session subclass, and SQLAlchemy
    keeps event bookkeeping for every class it sees, so one per session grew a busy server's
    memory with every request."""
    with _lock:
        factory = _factories.get(engine)
        if factory is None:
            factory = _factories[engine] = sessionmaker(engine, expire_on_commit=False)
        return factory


@contextmanager
def session_scope(settings: Settings) -> Iterator[Session]:
    """A session on the database of `settings` that commits on success (after the registered
    `before_commit` hooks) and rolls back on error; `settings_of(session)` gives them back."""
    with _session_factory(get_engine(settings))() as session:
        # The hooks reach what these settings name (the job storage's S3 endpoint).
        session.info[SETTINGS_KEY] = settings
        try:
            yield session
            for hook in _BEFORE_COMMIT:
                hook(session)
            session.commit()
        except BaseException:
            session.rollback()
            raise


def settings_of(session: Session) -> Settings:
    """The settings a `session_scope` session was opened with: what code handed only a
    session uses (a lease, the job storage's endpoint), never the environment's."""
    settings: Settings = session.info[SETTINGS_KEY]
    return settings


def get_one(session: Session, model: type[T], key: object) -> T:
    """The row with this primary key; JobNotFound when it is gone (deleted meanwhile)."""
    row = session.get(model, key)
    if row is None:
        raise JobNotFound(f"no {model.__name__.lower()} {key!r}")
    return row


def read_one(settings: Settings, model: type[T], key: object) -> T:
    """`get_one` in a session of its own: the row as it stands now, detached from it."""
    with session_scope(settings) as session:
        return get_one(session, model, key)


@contextmanager
def read_connection(settings: Settings) -> Iterator[Connection]:
    """A connection for reads of columns only (no ORM session, no commit hooks): what the
    requests a server answers most use (a poll's ORM session was a fifth of its cost)."""
    with get_engine(settings).connect() as connection:
        yield connection


def changed(session: Session, statement: Executable) -> int:
    """How many rows an UPDATE or DELETE changed (the conditional transitions' verdict)."""
    return cast("CursorResult[Any]", session.execute(statement)).rowcount
