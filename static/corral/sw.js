// Corral's service worker (docs/attention.md), served at /sw.js so that it covers the site.
//
// - The app shell offline: the stylesheet, the scripts, the icons and an offline page are
//   cached at install; a page that cannot be fetched shows the offline page. Pages and
//   everything under /sessions/ (transcripts, exports, images) are never cached: a
//   conversation is read from the server or not at all.
// - Web Push: a message ({title, body, url, tag}, attention_app/push.py) is shown as a
//   notification; clicking it opens the call's card (or focuses a tab already there).
"use strict";
const SHELL = "corral-shell-v1";
const SHELL_FILES = [
  "/static/corral/corral.css", "/static/corral/attention.js", "/static/corral/session.js",
  "/static/vendor/htmx.min.js", "/static/corral/favicon.svg", "/static/corral/favicon-alert.svg",
  "/static/corral/icon-192.png", "/static/corral/icon-512.png", "/static/corral/offline.html",
];

self.addEventListener("install", function (event) {
  event.waitUntil(caches.open(SHELL).then(function (cache) { return cache.addAll(SHELL_FILES); })
    .then(function () { return self.skipWaiting(); }));
});

self.addEventListener("activate", function (event) {
  event.waitUntil(caches.keys().then(function (names) {
    return Promise.all(names.filter(function (n) { return n !== SHELL; }).map(function (n) { return caches.delete(n); }));
  }).then(function () { return self.clients.claim(); }));
});

self.addEventListener("fetch", function (event) {
  const request = event.request;
  const url = new URL(request.url);
  if (request.method !== "GET" || url.origin !== self.location.origin) return;
  if (request.mode === "navigate") {
    // Always from the network (never stored); the offline page only when it cannot answer.
    event.respondWith(fetch(request).catch(function () {
      return caches.match("/static/corral/offline.html");
    }));
    return;
  }
  if (SHELL_FILES.indexOf(url.pathname) !== -1) {
    // The shell: the network first (a new version shows at once), the cache when offline.
    event.respondWith(fetch(request).then(function (response) {
      if (response.ok) {
        const copy = response.clone();
        caches.open(SHELL).then(function (cache) { cache.put(request, copy); });
      }
      return response;
    }).catch(function () { return caches.match(request); }));
  }
  // Everything else (transcripts, exports, images, fragments) goes to the network untouched.
});

self.addEventListener("push", function (event) {
  let message = {};
  try { message = event.data ? event.data.json() : {}; } catch (err) { message = { title: event.data.text() }; }
  const title = message.title || "A question waits in Corral";
  event.waitUntil(self.registration.showNotification(title, {
    body: message.body || "", tag: message.tag || "corral", data: { url: message.url || "/inbox/" },
    icon: "/static/corral/icon-192.png", badge: "/static/corral/icon-192.png",
  }));
});

self.addEventListener("notificationclick", function (event) {
  event.notification.close();
  const target = new URL((event.notification.data && event.notification.data.url) || "/inbox/", self.location.origin);
  event.waitUntil(self.clients.matchAll({ type: "window", includeUncontrolled: true }).then(function (windows) {
    for (const client of windows) {
      if (new URL(client.url).pathname === target.pathname && "focus" in client) {
        return client.navigate(target.href).then(function (c) { return (c || client).focus(); });
      }
    }
    return self.clients.openWindow(target.href);
  }));
});
