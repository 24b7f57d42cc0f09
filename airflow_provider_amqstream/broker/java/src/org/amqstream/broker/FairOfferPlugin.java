package org.amqstream.broker;

import java.util.Set;
import java.util.concurrent.ConcurrentHashMap;

import org.apache.activemq.broker.Broker;
import org.apache.activemq.broker.BrokerFilter;
import org.apache.activemq.broker.BrokerPlugin;
import org.apache.activemq.broker.BrokerService;
import org.apache.activemq.broker.ConnectionContext;
import org.apache.activemq.broker.ProducerBrokerExchange;
import org.apache.activemq.broker.region.MessageReference;
import org.apache.activemq.broker.region.policy.PolicyEntry;
import org.apache.activemq.broker.region.policy.PolicyMap;
import org.apache.activemq.command.ActiveMQDestination;
import org.apache.activemq.command.ActiveMQQueue;
import org.apache.activemq.command.Message;
import org.apache.activemq.jaas.UserPrincipal;
import org.apache.activemq.security.SecurityContext;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * Stamps each offer's priority from how many offers its sender already has pending on that
 * queue of offers, so that another user's first offer is dispatched ahead of one user's backlog
 * (docs/decisions/fair-share.md).
 *
 * <p>A queue of offers is a queue whose name has no {@code .amqs} element (a stream's data,
 * parked, control and held queues all do) and is not a DLQ or ActiveMQ's own. The sender is
 * the user the broker authenticated, as the JMSXUserID stamp names it, never what the frame
 * says. Its first pending offer gets 9, its second 4 (KahaDB's default category), further
 * ones 3, 2, 1 and then 0: KahaDB keeps three categories (above 4, 4, below 4) and pages in
 * the higher first; the paged-in list is sorted by the full priority. The count goes down
 * when the broker removes an offer (acknowledged, expired, sent to a DLQ, purged): Queue
 * reports that through messageConsumed only with {@code advisoryForConsumed}, which the
 * offer queues' policy sets along with {@code prioritizedMessages}. That policy is the
 * entry the configuration names {@link #OFFER_POLICY}; the broker's policy map hands it to
 * every queue of offers. Counts live in memory: after a restart they start at 0.
 */
public class FairOfferPlugin implements BrokerPlugin {

    /** The queue name of the policy entry the queues of offers are given. */
    public static final String OFFER_POLICY = "amqs_offer_queues";

    private static final Logger LOG = LoggerFactory.getLogger(FairOfferPlugin.class);

    @Override
    public Broker installPlugin(Broker broker) {
        BrokerService service = broker.getBrokerService();
        PolicyMap all = service.getDestinationPolicy();
        PolicyEntry offers = all == null ? null : all.getEntryFor(new ActiveMQQueue(OFFER_POLICY));
        if (offers == null || !offers.isPrioritizedMessages() || !offers.isAdvisoryForConsumed()) {
            LOG.warn("No policy entry {} with prioritizedMessages and advisoryForConsumed: offers are not"
                     + " prioritised by their sender's backlog", OFFER_POLICY);
            return broker;
        }
        service.setDestinationPolicy(new OfferPolicyMap(all, offers));
        LOG.info("Offers are prioritised by how many their sender has pending on the queue");
        return new Filter(broker);
    }

    static boolean isOfferQueue(ActiveMQDestination dest) {
        if (dest == null || !dest.isQueue() || dest.isTemporary() || dest.isComposite()) {
            return false;
        }
        String name = dest.getPhysicalName();
        return !name.startsWith("DLQ.") && !name.startsWith("ActiveMQ.") && !(name + ".").contains(".amqs.")
                && !name.contains(".amqs_");
    }

    /** The broker's policy map, with the offers' entry for every queue of offers. */
    static final class OfferPolicyMap extends PolicyMap {
        private final PolicyMap all;
        private final PolicyEntry offers;

        OfferPolicyMap(PolicyMap all, PolicyEntry offers) {
            this.all = all;
            this.offers = offers;
            // Callers that read the default entry directly, not through getEntryFor, see the broker's.
            setDefaultEntry(all.getDefaultEntry());
        }

        @Override
        public PolicyEntry getEntryFor(ActiveMQDestination destination) {
            return isOfferQueue(destination) ? offers : all.getEntryFor(destination);
        }
    }

    static final class Filter extends BrokerFilter {
        // "<queue>\0<user>" -> offers pending; a key is dropped when its count reaches 0.
        private final ConcurrentHashMap<String, Integer> pending = new ConcurrentHashMap<>();

        Filter(Broker next) {
            super(next);
        }

        @Override
        public void send(ProducerBrokerExchange exchange, Message message) throws Exception {
            ActiveMQDestination dest = message.getDestination();
            if (!isOfferQueue(dest)) {
                super.send(exchange, message);
                return;
            }
            ConnectionContext context = exchange.getConnectionContext();
            // UserIDBroker stamps the same name further down the chain; set here, it is also
            // what messageConsumed finds on the message. A bridge's message keeps its stamp.
            if (!context.isNetworkConnection() || message.getUserID() == null) {
                message.setUserID(userOf(context));
            }
            String key = key(dest, message.getUserID());
            int ahead = pending.merge(key, 1, Integer::sum) - 1;
            message.setPriority((byte) (ahead == 0 ? 9 : Math.max(0, 5 - ahead)));
            boolean sent = false;
            try {
                super.send(exchange, message);
                sent = true;
            } finally {
                if (!sent) {
                    release(key);
                }
            }
        }

        @Override
        public void messageConsumed(ConnectionContext context, MessageReference reference) {
            Message message = reference.getMessage();
            if (message != null && isOfferQueue(message.getDestination())) {
                release(key(message.getDestination(), message.getUserID()));
            }
            super.messageConsumed(context, reference);
        }

        private void release(String key) {
            // Offers stored before a restart were never counted: nothing to take back.
            pending.computeIfPresent(key, (k, n) -> n > 1 ? n - 1 : null);
        }

        private static String key(ActiveMQDestination dest, String user) {
            return dest.getPhysicalName() + '\0' + (user == null ? "" : user);
        }

        private static String userOf(ConnectionContext context) {
            // As UserIDBroker with useAuthenticatedPrincipalForJMSXUserID: the principal first.
            SecurityContext security = context.getSecurityContext();
            Set<?> principals = security == null ? null : security.getPrincipals();
            if (principals != null) {
                for (Object candidate : principals) {
                    if (candidate instanceof UserPrincipal) {
                        return ((UserPrincipal) candidate).getName();
                    }
                }
            }
            return context.getUserName();
        }
    }
}
