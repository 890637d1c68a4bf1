// The page talks to the same JSON API that `ralm serve` documents at /docs.
const $ = (id) => document.getElementById(id);

function escapeHtml(s) {
  return s.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}

// The evidence text with the answer span (character offsets) highlighted.
function highlighted(text, span) {
  if (!span) return escapeHtml(text);
  const [a, b] = span;
  return escapeHtml(text.slice(0, a)) + "<mark>" + escapeHtml(text.slice(a, b)) + "</mark>" + escapeHtml(text.slice(b));
}

async function api(path, body, method = "POST", key = "") {
  const headers = { "Content-Type": "application/json" };
  if (key) headers["X-API-Key"] = key;
  const res = await fetch(path, { method, headers, body: body ? JSON.stringify(body) : undefined });
  const data = await res.json().catch(() => ({}));
  if (!res.ok) throw new Error(data.error || `HTTP ${res.status}`);
  return data;
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

function renderPassages(items, withSpans, best) {
  $("evidence").innerHTML = items.map((e, i) => {
    const score = withSpans
      ? `retrieval ${e.retrieval_score.toFixed(3)} · p(z|x) ${(e.retrieval_prob ?? 0).toFixed(3)} · p(span) ${(e.span_prob ?? 0).toFixed(3)}`
      : `score ${e.score.toFixed(3)}`;
    return `<li class="${i === best ? "best" : ""}"><span class="title">${escapeHtml(e.title || e.id)}</span>` +
      `<span class="scores">${escapeHtml(e.id)} · ${score}</span><div class="text">${highlighted(e.text, withSpans && i === best ? e.span : null)}</div></li>`;
  }).join("");
}

async function ask(event) {
  event.preventDefault();
  const question = $("question").value.trim();
  if (!question) return;
  const retriever = $("retriever").value || undefined;
  $("ask-button").disabled = true;
  showError("");
  try {
    if (window.readerLoaded) {
      const r = await api("/ask", { question, retriever });  // the server's default k, which the confidence is calibrated for
      $("answer").hidden = false;
      $("answer-text").textContent = r.answer || "(no answer)";
      $("answer-score").textContent = `score ${r.score.toFixed(4)}`;
      renderPassages(r.evidence, true, r.best ?? 0);
    } else {
      const hits = await api("/search", { query: question, k: 5, retriever });
      $("answer").hidden = true;
      renderPassages(hits, false, -1);
    }
  } catch (e) {
    showError(e.message);
  } finally {
    $("ask-button").disabled = false;
  }
}

async function addDocument(event) {
  event.preventDefault();
  $("doc-button").disabled = true;
  try {
    const doc = { id: $("doc-id").value.trim(), title: $("doc-title").value.trim(), text: $("doc-text").value.trim() };
    const r = await api("/documents", { documents: [doc] }, "POST", $("api-key").value);
    $("doc-status").textContent = `added ${r.added.join(", ")}; the corpus now has ${r.corpus_blocks} blocks`;
  } catch (e) {
    $("doc-status").textContent = `error: ${e.message}`;
  } finally {
    $("doc-button").disabled = false;
  }
}

async function init() {
  try {
    const s = await fetch("/stats").then((r) => r.json());
    window.readerLoaded = s.reader_loaded;
    $("status").textContent = `${s.corpus_blocks} blocks · index ${s.index_version}` + (s.reader_loaded ? "" : " · no reader: showing passages");
    $("retriever").innerHTML = s.retrievers.map((r) => `<option value="${r}">${r}</option>`).join("");
  } catch (e) {
    $("status").textContent = "server unreachable";
  }
}

$("ask-form").addEventListener("submit", ask);
$("doc-form").addEventListener("submit", addDocument);
init();
