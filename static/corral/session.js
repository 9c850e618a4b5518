// Live transcript for the session page (docs/behaviour.md §12, docs/behaviour.md C17, C19).
//
// The socket is owned by this script, not by any element htmx may swap, so a swap never
// closes it or opens a second one. Every server message is {seq, ops}; seq only grows.
// On reconnect the page asks for everything after the last seq it applied, so nothing is
// lost or shown twice. A close with one of the codes the page has a sentence for
// (#conn-closed) ends the retries; docs/live-page.md lists them.
(function () {
  "use strict";
  const root = document.getElementById("session");
  if (!root) return;
  let lastSeq = parseInt(root.dataset.lastSeq || "0", 10);
  let socket = null;
  let retry = 500;
  const conn = document.getElementById("conn-state");
  // The statuses in which the session has no server (AgentSession.Status.server_down).
  const downStatuses = (root.dataset.down || "").split(" ").filter(Boolean);
  // The statuses in which a reply can be under way, so Stop reply can do something
  // (AgentSession.Status.reply_possible); in the others it is inactive (docs/live-page.md).
  const replyStatuses = (root.dataset.reply || "").split(" ").filter(Boolean);

  // Whether the transcript holds a message to edit or send again (the page's, or one
  // that arrived live).
  function hasMessage() {
    return root.dataset.hasMessage === "1" || !!document.querySelector("#transcript .msg.user");
  }

  // Follow the status: a session without a server gets a disabled composer with its
  // Restart button showing; any feedback line (#…-feedback, the composer's error) spoke
  // of the state that just ended, so it goes (docs/live-page.md, "Feedback").
  function syncStatus(status, changed) {
    root.dataset.status = status;
    const down = downStatuses.indexOf(status) !== -1;
    // A control that can do nothing now is inactive: no server to stop, no reply to stop,
    // no message to edit or send again.
    const inactive = {"id_text": down, "send-button": down, "regenerate-button": down || !hasMessage(),
                      "edit-last-button": down || !hasMessage(), "stop-button": replyStatuses.indexOf(status) === -1,
                      "stop-server-button": down};
    Object.keys(inactive).forEach(function (id) {
      const el = document.getElementById(id);
      if (el) el.disabled = inactive[id];
    });
    const panel = document.getElementById("composer-down");
    if (panel) {
      panel.hidden = !down;
      const word = panel.querySelector(".down-word");
      const badge = document.getElementById("status-badge");
      if (word && badge) word.textContent = badge.textContent;
    }
    const progress = document.getElementById("progress");
    if (progress && status !== "running") { progress.hidden = true; progress.textContent = ""; }
    if (!changed) return;
    // A note that holds until a given status (the restart banner: until the server restarts).
    document.querySelectorAll("[data-gone-when]").forEach(function (el) {
      if (el.dataset.goneWhen.split(" ").indexOf(status) !== -1) el.remove();
    });
    document.querySelectorAll(".feedback").forEach(function (el) {
      el.replaceChildren();
      if (el.id === "composer-error") el.hidden = true;
    });
  }

  // --- Markdown while it streams (docs/live-page.md, "Markdown while it streams").
  // The server sends a streaming reply as plain text (.raw); at most every PREVIEW_EVERY ms
  // the page renders that text as Markdown with markdown-it and sanitises it with DOMPurify,
  // to the server's own allow-list (data-md-tags: sessions_app/live/markdown.py), into a
  // .preview beside it. When the reply ends the server's rendering replaces both.
  const PREVIEW_EVERY = 150;
  const mdTags = (root.dataset.mdTags || "").split(" ").filter(Boolean);
  const md = window.markdownit && window.DOMPurify
    ? window.markdownit("commonmark", { html: false }).enable(["table", "strikethrough"]) : null;
  const mdAttrs = (root.dataset.mdAttrs || "href class").split(" ").filter(Boolean);
  if (md) {
    // Never load an image a model names (a remote image leaks data by its URL): its alt text.
    md.renderer.rules.image = function (tokens, idx) { return md.utils.escapeHtml(tokens[idx].content); };
    mathRules(md);
    // A table column's alignment as a class, as the server renders it (sessions_app/live/markdown.py,
    // ALIGN_CLASSES): a style attribute breaks the page's CSP (style-src-attr) even while
    // DOMPurify parses it.
    md.core.ruler.push("alignment_as_class", function (state) {
      state.tokens.forEach(function (token) {
        const style = token.attrGet && token.attrGet("style");
        const align = style && /^text-align:(left|center|right)$/.exec(style);
        if (!style) return;
        token.attrs = token.attrs.filter(function (attr) { return attr[0] !== "style"; });
        if (align) token.attrJoin("class", "align-" + align[1]);
      });
    });
    window.DOMPurify.addHook("afterSanitizeAttributes", function (node) {
      if (node.tagName === "A") node.setAttribute("rel", "noopener noreferrer nofollow");
    });
  }
  // TeX while it streams: the same $…$ / $$…$$ rules as the server (sessions_app/tex.py);
  // each formula is drawn with the MathML the server sent for it (the reply's .math-list),
  // or shown as its source until that comes. No TeX is ever rendered here.
  function formulasOf(el) {
    const found = {};
    el.querySelectorAll(".math-list > span[data-tex]").forEach(function (span) {
      found[span.dataset.display + span.dataset.tex] = span.innerHTML;
    });
    return found;
  }
  function mathRules(parser) {
    function closing(src, pos, end) {
      while (pos < end) {
        const c = src[pos];
        if (c === "\\") { pos += 2; continue; }
        if (c === "`") return -1;
        if (c === "$") return !/\s/.test(src[pos - 1]) && !/[0-9]/.test(src[pos + 1] || "") ? pos : -1;
        pos += 1;
      }
      return -1;
    }
    parser.inline.ruler.before("escape", "math_inline", function (state, silent) {
      const src = state.src, pos = state.pos, end = state.posMax;
      if (src[pos] !== "$") return false;
      let tex, display, after;
      if (src.startsWith("$$", pos)) {
        const close = src.indexOf("$$", pos + 2);
        if (close === -1 || close + 2 > end || close === pos + 2) return false;
        tex = src.slice(pos + 2, close); display = true; after = close + 2;
      } else {
        if (pos + 1 >= end || /\s/.test(src[pos + 1])) return false;
        const close = closing(src, pos + 1, end);
        if (close === -1) return false;
        tex = src.slice(pos + 1, close); display = false; after = close + 1;
      }
      if (!silent) {
        const token = state.push("math_inline", "math", 0);
        token.content = tex.trim();
        token.meta = { display: display };
      }
      state.pos = after;
      return true;
    });
    parser.block.ruler.before("fence", "math_block", function (state, startLine, endLine, silent) {
      const begin = state.bMarks[startLine] + state.tShift[startLine];
      if (state.sCount[startLine] - state.blkIndent >= 4 || !state.src.startsWith("$$", begin)) return false;
      const first = state.src.slice(begin + 2, state.eMarks[startLine]).trimEnd();
      let body, last;
      if (first.endsWith("$$")) {
        body = first.slice(0, -2); last = startLine;
        if (!body.trim()) return false;
      } else if (first.trim()) {
        return false;
      } else {
        const lines = [];
        let line = startLine + 1;
        for (; line < endLine; line++) {
          const text = state.src.slice(state.bMarks[line] + state.tShift[line], state.eMarks[line]).trimEnd();
          if (text.endsWith("$$")) { lines.push(text.slice(0, -2)); break; }
          lines.push(text);
        }
        if (line >= endLine) return false;
        body = lines.join("\n"); last = line;
      }
      if (silent) return true;
      const token = state.push("math_block", "math", 0);
      token.block = true;
      token.content = body.trim();
      token.meta = { display: true };
      token.map = [startLine, last + 1];
      state.line = last + 1;
      return true;
    }, { alt: ["paragraph", "reference", "blockquote", "list"] });
    function draw(tokens, idx, options, env) {
      const token = tokens[idx];
      const key = (token.meta.display ? "1" : "0") + token.content;
      const known = env && env.formulas && env.formulas[key];
      if (known) return known;
      const fence = token.meta.display ? "$$" : "$";
      return '<code class="math-pending">' + parser.utils.escapeHtml(fence + token.content + fence) + "</code>";
    }
    parser.renderer.rules.math_inline = draw;
    parser.renderer.rules.math_block = function (tokens, idx, options, env) { return draw(tokens, idx, options, env) + "\n"; };
  }

  const previews = new Set();
  let previewTimer = null;

  function schedulePreview(el) {
    if (!md || !el || !el.classList.contains("assistant") || !el.classList.contains("streaming")) return;
    previews.add(el);
    if (previewTimer === null) previewTimer = setTimeout(renderPreviews, PREVIEW_EVERY);
  }

  function renderPreviews() {
    previewTimer = null;
    previews.forEach(function (el) {
      const raw = el.querySelector(".raw");
      if (!el.isConnected || !raw) return;
      let view = el.querySelector(".preview");
      if (!view) {
        view = document.createElement("div");
        view.className = "body md preview";
        raw.after(view);
        raw.hidden = true;
      }
      view.innerHTML = window.DOMPurify.sanitize(md.render(raw.textContent, { formulas: formulasOf(el) }), {
        ALLOWED_TAGS: mdTags, ALLOWED_ATTR: mdAttrs, ALLOWED_URI_REGEXP: /^(?:https?|mailto):/i,
      });
      decorate(el);
    });
    previews.clear();
  }

  // --- Copy: a button on each finished message and on each code block (text via CSS, so a
  // message's own text never includes the button's word).
  function copyButton(what, label) {
    const button = document.createElement("button");
    button.type = "button";
    button.className = "copy";
    button.dataset.copy = what;
    button.setAttribute("aria-label", label);
    return button;
  }

  // The waiting note polls only while a turn is open (the server draws it so): ask for it
  // again when a turn may have opened or ended, so it starts or stops polling.
  // One request at a time (the note's hx-sync drops a second): a refresh asked for while
  // one is on its way is sent when that one has ended, never by aborting it (an abort is
  // logged by htmx as two console errors).
  let waitingBusy = false;
  let waitingAgain = false;
  function refreshWaiting() {
    if (waitingBusy) { waitingAgain = true; return; }
    const note = document.getElementById("waiting-note");
    if (note && window.htmx) window.htmx.trigger(note, "refresh");
  }
  function refreshAgain() {
    if (waitingAgain) { waitingAgain = false; refreshWaiting(); }
  }
  document.body.addEventListener("htmx:beforeRequest", function (e) {
    const note = e.detail.elt;
    if (!note || note.id !== "waiting-note" || !e.detail.xhr) return;
    waitingBusy = true;
    e.detail.xhr.addEventListener("loadend", function () {
      waitingBusy = false;
      // The answer replaced the note (htmx swaps on load): the new one takes a refresh once
      // htmx has processed it (htmx:load, below). No answer swapped in: ask again now.
      if (note.isConnected) refreshAgain();
    });
  });
  document.body.addEventListener("htmx:load", function (e) {
    if (e.detail.elt && e.detail.elt.id === "waiting-note" && !waitingBusy) refreshAgain();
  });

  function decorate(scope) {
    if (!scope || !scope.querySelectorAll) return;
    const messages = scope.matches && scope.matches(".msg") ? [scope] : scope.querySelectorAll(".msg");
    messages.forEach(function (msg) {
      if (!(msg.classList.contains("user") || msg.classList.contains("assistant"))) return;
      if (msg.classList.contains("streaming") || msg.classList.contains("pending")) return;
      if (!msg.querySelector(":scope > .msg-tools")) {
        const tools = document.createElement("div");
        tools.className = "msg-tools";
        tools.appendChild(copyButton("message", "Copy this message"));
        msg.appendChild(tools);
      }
    });
    scope.querySelectorAll(".body.md pre").forEach(function (pre) {
      if (!pre.querySelector(":scope > button.copy")) pre.appendChild(copyButton("code", "Copy this code"));
    });
  }

  function copyText(text, button) {
    function done() {
      button.dataset.copied = "1";
      setTimeout(function () { delete button.dataset.copied; }, 1500);
    }
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(done, function () { fallbackCopy(text) && done(); });
    } else if (fallbackCopy(text)) {
      done();
    }
  }

  function fallbackCopy(text) {  // a page served over plain http to another host has no clipboard API
    const area = document.createElement("textarea");
    area.value = text;
    area.setAttribute("readonly", "");
    area.className = "visually-hidden";
    document.body.appendChild(area);
    area.select();
    let ok = false;
    try { ok = document.execCommand("copy"); } catch (err) { ok = false; }
    area.remove();
    return ok;
  }

  document.addEventListener("click", function (e) {
    const button = e.target.closest && e.target.closest("button.copy");
    if (!button) return;
    let text = "";
    if (button.dataset.copy === "code") {
      const code = button.parentElement.querySelector("code") || button.parentElement;
      text = code.innerText;
    } else {
      const body = button.closest(".msg").querySelector(".body:not([hidden]):not(.raw), .body");
      text = body ? body.innerText : "";
    }
    copyText(text.replace(/\n$/, ""), button);
  });

  function followTitle() {
    const heading = document.getElementById("session-title");
    if (heading) document.title = heading.textContent.trim() + " — Corral";
  }

  // What the header says of the live link. "reconnecting" follows a socket that closed
  // (network, a daphne restart, Redis down: sessions_app/live/live_link.py): the page no longer
  // shows what happens until it is back, and says so in words.
  const CONN_WORDS = {
    live: "live",
    closed: "closed",
    connecting: "connecting…",
    reconnecting: "live link lost: reconnecting…",
  };
  const CONN_TITLES = {
    reconnecting: "Updates are not reaching this page; it tries again every few seconds and catches up once " +
      "back. What you send is kept and runs then.",
  };
  function setConn(state) {
    if (conn) {
      conn.dataset.state = state;
      conn.textContent = CONN_WORDS[state] || state;
      conn.title = CONN_TITLES[state] || "";
    }
  }

  function apply(op) {
    if (op.op === "append") {
      const target = document.getElementById(op.target);
      if (target) target.insertAdjacentHTML("beforeend", op.html);
    } else if (op.op === "replace") {
      const el = document.getElementById(op.id);
      if (el) el.outerHTML = op.html;
      if (op.id === "session-title") followTitle();  // a rename, here or elsewhere
    } else if (op.op === "remove") {
      const el = document.getElementById(op.id);
      if (el) el.remove();
    } else if (op.op === "text") {
      // Stored text: it goes before the block's tail, which it replaces (docs/live-page.md).
      const el = document.getElementById(op.id);
      const raw = el && el.querySelector(".raw");
      const tail = raw && raw.querySelector(".tail");
      if (raw) raw.insertBefore(document.createTextNode(op.text), tail);  // text, never markup
      if (tail) tail.textContent = "";
    } else if (op.op === "tail") {
      // Text streamed but not stored yet, shown until the stored text replaces it.
      const el = document.getElementById(op.id);
      const tail = el && el.querySelector(".raw .tail");
      if (tail) tail.textContent = op.text;  // text, never markup
    } else if (op.op === "exchange") {
      // Another version of a message is in force: what each version started shows or hides.
      document.querySelectorAll('#transcript [data-exchange="' + Number(op.seq) + '"]').forEach(function (el) {
        el.hidden = !!op.hidden;
      });
    } else if (op.op === "progress") {
      // How far the completion is (docs/live-page.md, "Progress"): until the turn ends.
      const line = document.getElementById("progress");
      if (line && root.dataset.status === "running") { line.textContent = op.text; line.hidden = false; }  // text, never markup
    } else if (op.op === "value") {
      const el = document.getElementById(op.id);
      if (el && el.value !== op.value) el.value = op.value;
    } else if (op.op === "reload") {
      location.reload();  // the user's rights changed: the server draws the page again
      return;
    } else if (op.op === "status") {
      const badge = document.getElementById("status-badge");
      if (badge) { badge.outerHTML = op.html.replace("<span ", '<span id="status-badge" '); }
      syncStatus(op.status, op.status !== root.dataset.status);
      refreshWaiting();  // a turn may have ended (or started running)
    }
    // New markup may carry hx- attributes (question buttons, withdraw): let htmx see it.
    const fresh = op.op === "append" ? (document.getElementById(op.target) || {}).lastElementChild
      : op.op === "replace" ? document.getElementById(op.id)
      : op.op === "text" || op.op === "tail" ? document.getElementById(op.id) : null;
    const textOnly = op.op === "text" || op.op === "tail";  // plain text: no new markup to process
    if (fresh && !textOnly && window.htmx) window.htmx.process(fresh);
    if (fresh && fresh.classList && fresh.classList.contains("user")) {
      refreshWaiting();  // a turn opened
      syncStatus(root.dataset.status, false);  // there is a message to edit or send again now
    }
    if (fresh) {
      schedulePreview(fresh);  // the preview renders the stored text and the tail together
      if (!textOnly) decorate(fresh);
    }
  }

  function connect() {
    const scheme = location.protocol === "https:" ? "wss://" : "ws://";
    socket = new WebSocket(scheme + location.host + root.dataset.wsPath + "?after=" + lastSeq);
    setConn("connecting");
    socket.onopen = function () {
      retry = 500;
      setConn("live");
      // A tail is never counted in lastSeq: the catch-up brings its text again, stored.
      document.querySelectorAll("#transcript .tail").forEach(function (t) { t.textContent = ""; });
    };
    socket.onmessage = function (e) {
      const msg = JSON.parse(e.data);
      if (msg.seq === undefined) {             // not a transcript event (who is watching): apply as is
        msg.ops.forEach(apply);
        return;
      }
      if (msg.seq <= lastSeq) return;          // already applied
      if (msg.seq !== lastSeq + 1) {           // a gap: start over from what we have
        socket.close();
        return;
      }
      msg.ops.forEach(apply);  // follow.js keeps the reader at the bottom, or offers "new messages"
      lastSeq = msg.seq;
      root.dataset.lastSeq = String(lastSeq);
    };
    socket.onclose = function (e) {
      // A close code the page has a sentence for is final: say why and how to go on
      // (log in again, back to the list, not shared any more) instead of retrying for ever.
      const reason = document.querySelector('#conn-closed [data-close-code="' + Number(e.code) + '"]');
      if (reason) {
        reason.hidden = false;
        reason.parentElement.hidden = false;
        setConn("closed");
        const composer = document.getElementById("composer-wrap");
        if (composer) composer.remove();  // nothing sent from here would be seen
        const waiting = document.getElementById("waiting-note");
        if (waiting) waiting.remove();  // its poll would swap in the login page or log 404s
        return;
      }
      setConn("reconnecting");
      setTimeout(connect, retry);
      retry = Math.min(retry * 2, 5000);
    };
  }

  // Edit last message: its text back in the box; the send then replaces it (views.session_send).
  function editLast(on) {
    const box = document.getElementById("id_text");
    const flag = document.getElementById("id_edit");
    const note = document.getElementById("editing-note");
    if (!box || !flag || !note || box.disabled) return;
    if (on) {
      const mine = document.querySelectorAll("#transcript .msg.user:not([hidden]) .body");
      if (!mine.length) return;
      box.value = mine[mine.length - 1].innerText;
    } else {
      box.value = "";
    }
    flag.value = on ? "last" : "";
    note.hidden = !on;
    box.focus();
  }
  document.addEventListener("click", function (e) {
    if (e.target.closest && e.target.closest("#edit-last-button")) editLast(true);
    else if (e.target.closest && e.target.closest("#edit-cancel")) editLast(false);
  });

  // Keyboard (listed under "Keyboard shortcuts" by the message box): Enter sends,
  // Shift+Enter makes a new line, Esc stops the reply, ↑ in an empty box edits the last message.
  document.addEventListener("keydown", function (e) {
    if (!e.target || e.target.id !== "id_text") return;
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      const form = e.target.form;
      if (form) form.requestSubmit();
    } else if (e.key === "Escape") {
      const stop = document.getElementById("stop-button");
      if (stop && stop.disabled) {  // nothing to stop: say so where the button is
        e.preventDefault();
        const feedback = document.getElementById("composer-feedback");
        if (feedback) feedback.textContent = stop.dataset.idleNote || "";
      } else if (stop) { e.preventDefault(); stop.click(); }
    } else if (e.key === "ArrowUp" && !e.target.value) {
      e.preventDefault();
      editLast(true);
    }
  });
  // After a send the composer is swapped: keep the focus in the text box.
  document.body.addEventListener("htmx:afterSwap", function (e) {
    if (e.target && e.target.id === "composer-wrap") {
      syncStatus(root.dataset.status, false);  // the status may have moved while the send was on its way
      const box = document.getElementById("id_text");
      if (box && !box.disabled) box.focus();
    }
  });

  // htmx never swaps an error response. A request too large for the server (413) gets a
  // sentence from it: show it where the person typed (the composer), else in #flash.
  document.body.addEventListener("htmx:responseError", function (e) {
    const xhr = e.detail.xhr;
    if (!xhr || xhr.status !== 413) return;
    let slot = e.detail.elt && e.detail.elt.id === "composer" ? document.getElementById("composer-error") : null;
    if (!slot) {
      slot = document.createElement("p");
      slot.className = "error";
      const flash = document.getElementById("flash");
      if (!flash) return;
      flash.replaceChildren(slot);
    }
    slot.textContent = xhr.responseText;  // text, never markup
    slot.hidden = false;
  });

  // Rename in place: the heading's Rename opens a one-line form; Escape or Cancel closes it.
  const renameButton = document.getElementById("rename-button");
  const renameForm = document.getElementById("rename-form");
  function showRename(open) {
    if (!renameButton || !renameForm) return;
    renameForm.hidden = !open;
    renameButton.hidden = open;
    renameButton.setAttribute("aria-expanded", String(open));
    if (open) { const input = document.getElementById("rename-title"); input.focus(); input.select(); }
    else renameButton.focus();
  }
  if (renameButton && renameForm) {
    renameButton.addEventListener("click", function () { showRename(true); });
    document.getElementById("rename-cancel").addEventListener("click", function () { showRename(false); });
    renameForm.addEventListener("keydown", function (e) { if (e.key === "Escape") showRename(false); });
    document.body.addEventListener("htmx:afterSwap", function (e) {
      if (e.target && e.target.id === "rename-feedback" && !e.target.querySelector(".error")) showRename(false);
    });
  }

  syncStatus(root.dataset.status || "", false);
  decorate(document.getElementById("transcript"));
  document.querySelectorAll("#transcript .msg.assistant.streaming").forEach(schedulePreview);
  connect();
})();
